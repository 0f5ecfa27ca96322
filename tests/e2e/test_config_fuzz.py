"""Property-based fuzzing of configurations, launched: a few drawn configurations
(:mod:`config_strategies`) run as real two-rank runs of one step, where every rank writes down
its own exit status; a configuration that validates trains its step, one that does not (or whose
data refuses it: a split too small for --eval-batches) exits 2
on every rank with validation's message, printed once. The examples are derandomized so that CI
sees the same ones every time."""
from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import textwrap
import time

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from config_strategies import configs, validation_error
from conftest import MPIRUN, needs_mpirun
from mpipar.config import ConfigError


def _run_error(config: str, world: int) -> str | None:
    """The error a run of ``world`` ranks on this node stops with before it allocates anything
    (the configuration as ``python -m mpipar.train --config`` resolves it, layout choice
    included, then the memory check), or None."""
    from mpipar.plan.admission import check_memory
    from mpipar.train import resolve_config
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            cfg = resolve_config(["--config", config], world)
        check_memory(cfg, 0, world)
    except SystemExit:
        return printed.getvalue().strip().removeprefix("mpipar: error: ")
    except ConfigError as exc:
        return str(exc)
    return _data_error(cfg)


def _data_error(cfg) -> str | None:
    """The error the run's data gives once it is read (every rank, before any collective): the
    rules that depend on the corpus, such as a validation split too small for --eval-batches,
    which validation cannot know."""
    from mpipar.data.sources import DataError, load_tokens, validation
    tr = cfg.train
    try:
        validation(load_tokens(tr.data or None, cfg.model.vocab_size, tr.seq_len), tr,
                   cfg.model.vocab_size)
    except DataError as exc:
        return str(exc)
    return None


RECORD_EXIT = """
    import atexit, os, sys
    from mpi4py import MPI
    from mpipar import train
    status = [None]
    def record():
        with open(os.path.join(sys.argv[1], f"exit.{MPI.COMM_WORLD.rank}"), "w") as fh:
            fh.write(str(status[0]))
    atexit.register(record)
    try:
        status[0] = train.main(sys.argv[2:])
    except SystemExit as exc:
        status[0] = exc.code
        raise
    sys.exit(status[0])
"""


LAUNCHED = {"any": configs(changes=2),
            "valid": configs(changes=2).filter(lambda data: validation_error(data, 2) is None)}
"""Launched examples: any configuration, and ones that validate (and so must train)."""


@needs_mpirun
@pytest.mark.parametrize("kind", list(LAUNCHED))
@settings(max_examples=2, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.filter_too_much])
@given(drawn=st.data())
def test_launched_configurations_run_a_step_or_exit_2_on_every_rank(tmp_path_factory, kind,
                                                                     drawn):
    """Two ranks from a TOML file: a configuration that validates runs its step (status 0, or 3
    when the values make the loss non-finite and --on-nan stop stops it with a checkpoint); one
    that does not exits 2 on both ranks with validation's message, printed once."""
    tmp = tmp_path_factory.mktemp("fuzz")
    data = {s: dict(v) for s, v in drawn.draw(LAUNCHED[kind]).items()}
    data["train"].update(steps=1, run_dir=str(tmp / "run"))
    (tmp / "c.toml").write_text(tomli_w.dumps(data))
    (tmp / "driver.py").write_text(textwrap.dedent(RECORD_EXIT))
    expected = _run_error(str(tmp / "c.toml"), 2)
    t0 = time.monotonic()
    proc = subprocess.run([MPIRUN, "-n", "2", sys.executable, str(tmp / "driver.py"), str(tmp),
                           "--config", str(tmp / "c.toml")], capture_output=True, text=True,
                          timeout=120)
    assert time.monotonic() - t0 < 90, data  # mpirun, imports and one small step
    statuses = [(tmp / f"exit.{r}").read_text() for r in range(2)]
    assert statuses[0] == statuses[1] == str(proc.returncode), (statuses, proc.stderr)
    if expected is not None:  # (the memory the node has left differs from moment to moment)
        expected = expected.split(" but this node has")[0]
        assert proc.returncode == 2 and proc.stderr.count(expected) == 1, (expected, proc.stderr)
        return
    assert proc.returncode in (0, 3), (data, proc.stderr)
    rows = (tmp / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1 and '"step": 1' in rows[0]
    if proc.returncode == 3:
        assert "is not finite (--on-nan stop)" in proc.stderr
