"""Run directories written by hand for the report tests, and what a report's PNGs must be."""
from __future__ import annotations

import json
import struct

from mpipar.observe.metrics import TIME_KEYS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("loss", "throughput", "time_breakdown", "memory", "timeline")


def record(step: int, loss: float, **time) -> dict:
    """A metrics.jsonl record of ``step``: ``loss``, and ``time`` seconds by TIME_KEYS (0 for
    the others), with the throughput, MFU, bytes and memory they imply."""
    t = {k: 0.0 for k in TIME_KEYS} | time
    total = sum(t.values())
    return {"step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens": 4096,
            "step_time_s": total, "tokens_per_s": 4096 / total, "flops": 1e9,
            "mfu": 1e9 / total / 1e11, "skipped": False, "skipped_steps": 0, "time": t,
            "time_max": t, "comm_bytes": {"pp": 1000}, "comm_bytes_max": {"pp": 1000},
            "memory_bytes": [200 * 2**20, 210 * 2**20]}


def write_run_dir(tmp_path, records, timeline=None, config: str = "") -> str:
    """A run directory ``tmp_path/run`` holding ``records`` as metrics.jsonl, ``timeline`` as
    timeline.json (if given) and ``config`` (default: pp = 2, one microbatch) as config.toml."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if timeline is not None:
        (run / "timeline.json").write_text(json.dumps(timeline))
    (run / "config.toml").write_text(config or '[parallel]\ndp = 1\ntp = 1\npp = 2\nsp = 1\n'
                                              '[train]\nglobal_batch_size = 2\n'
                                              'micro_batch_size = 2\n')
    return str(run)


def png_size(path: str) -> tuple[int, int]:
    """(width, height) of the PNG at ``path``; fails unless it starts as a PNG does."""
    with open(path, "rb") as fh:
        head = fh.read(24)
    assert head[:8] == PNG_MAGIC and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])
