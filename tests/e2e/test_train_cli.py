"""``python -m mpipar.train`` end to end: loss falls, files are written, failures abort."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import launch_env, mpirun, needs_mpirun
TINY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq-len", "64",
        "--global-batch-size", "8", "--log-every", "10"]


def _metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def test_fifty_steps_lower_the_loss_on_the_stdlib_corpus(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mpipar.train", *TINY, "--steps", "50",
                           "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=600,
                           env=launch_env())
    assert proc.returncode == 0, proc.stderr
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 51))
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s"):
        assert all(isinstance(r[key], float) for r in rows), key
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    # Byte-level model from scratch: starts near log(256) = 5.55, and 50 steps must cut it clearly.
    assert abs(first - 5.545) < 0.2 and last < first - 1.5, (first, last)
    # The LR schedule in the log is the configured one (cosine, 5 warm-up steps, peak 3e-3).
    assert rows[0]["lr"] == pytest.approx(3e-3 / 5) and rows[4]["lr"] == pytest.approx(3e-3)
    assert rows[-1]["lr"] < rows[10]["lr"]
    config = (tmp_path / "config.toml").read_text()
    assert "[model]" in config and "steps = 50" in config and "micro_batch_size = 8" in config
    assert "layout world=1 dp=1 tp=1 pp=1 sp=1" in proc.stdout


@needs_mpirun
def test_same_losses_under_mpirun_as_one_process(tmp_path):
    """The CLI path (not just the engine) is layout-invariant: float64, 3 steps."""
    common = [*TINY, "--steps", "3", "--dtype", "float64", "--backend", "numpy", "--micro-batch-size", "1"]
    one = subprocess.run([sys.executable, "-m", "mpipar.train", *common, "--run-dir", str(tmp_path / "a")],
                         capture_output=True, text=True, timeout=300, env=launch_env())
    four = subprocess.run([*mpirun(4), sys.executable, "-m", "mpipar.train", *common, "--tp", "2",
                           "--pp", "2", "--run-dir", str(tmp_path / "b")],
                          capture_output=True, text=True, timeout=300, env=launch_env())
    assert one.returncode == 0 and four.returncode == 0, one.stderr + four.stderr
    assert "layout world=4 dp=1 tp=2 pp=2 sp=1" in four.stdout
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-10 * x["loss"]
    assert b[0]["comm_bytes"]["tp"] > 0 and b[0]["comm_bytes"]["pp"] > 0


@needs_mpirun
def test_exception_on_one_rank_aborts_the_job(tmp_path):
    """Rank 1 raises in step 2 while the others wait in collectives: the job ends, quickly,
    with a non-zero status, naming the rank and showing the traceback."""
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""
        import sys
        from mpi4py import MPI
        from mpipar import train
        from mpipar.training import step as trainer
        real = trainer.train_step
        def step(rank, k):
            if k == 1 and MPI.COMM_WORLD.rank == 1:
                raise RuntimeError("injected failure on rank 1")
            return real(rank, k)
        trainer.train_step = step
        sys.exit(train.main(sys.argv[1:]))
    """))
    proc = subprocess.run([*mpirun(4), sys.executable, str(script), *TINY, "--steps", "5",
                           "--dp", "2", "--tp", "2", "--run-dir", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=240, env=launch_env())
    ended = time.time()
    assert proc.returncode == 1, proc.stderr
    # The durable report (the launcher may drop an aborting rank's stderr: not asserted). The
    # job ended within 30 s of the failure (start-up time on a loaded machine is not counted).
    from mpipar.training import failure
    [line] = failure.read(str(tmp_path / "r"))
    assert ended - line["time"] < 30
    assert (line["rank"], line["exit"], line["kind"]) == (1, 1, "exception")
    assert line["message"].startswith("mpipar: rank 1 failed; aborting all ranks\nTraceback")
    assert "RuntimeError: injected failure on rank 1" in line["message"]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failures"] == [line]


def test_bad_data_path_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mpipar.train", "--data", str(tmp_path / "nope.bin"),
                           "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=60,
                           env=launch_env())
    assert proc.returncode == 2 and "nope.bin" in proc.stderr


TIED_QWEN2 = dict(tie_embeddings=True, attention_bias=True, rope_type="llama3", rope_factor=4.0,
                  rope_original_max_positions=8)
"""A tied Qwen2 (q/k/v biases) with llama3 RoPE scaling, as mpipar writes it."""


def _hf_checkpoint(tmp_path, **model):
    """A small Llama (or, with ``model`` fields, e.g. a Qwen2) written in the Hugging Face format
    by mpipar itself (no torch needed); biases random, not zero."""
    import numpy as np

    from mpipar.config import ModelConfig
    from mpipar.checkpoint.huggingface import save_hf
    from mpipar.model.params import init_params

    from mpipar.layout import resolve_model
    cfg = resolve_model(ModelConfig(vocab_size=97, hidden=48, layers=2, heads=6, kv_heads=2,
                                    ffn_hidden=80, rope_theta=5000.0, init_std=0.1, **model))
    rng = np.random.default_rng(1)
    params = {n: rng.normal(0, 0.1, v.shape) if n.endswith(".bias") else v
              for n, v in init_params(cfg, 21, np.float64).items()}
    save_hf(tmp_path / "hf", cfg, params, dtype="float64")
    rng = np.random.default_rng(0)
    np.save(tmp_path / "data.npy", rng.integers(0, 97, size=(32, 17)))
    return tmp_path / "hf", tmp_path / "data.npy", params


def test_init_from_hf_and_export(tmp_path):
    import numpy as np

    from mpipar.checkpoint.huggingface import load_hf

    src, data, params = _hf_checkpoint(tmp_path)
    common = ["--init-from-hf", str(src), "--data", str(data), "--seq-len", "16",
              "--global-batch-size", "4", "--dtype", "float64", "--backend", "numpy"]
    # Zero steps: the exported weights are the imported ones, bit for bit, still float64.
    proc = subprocess.run([sys.executable, "-m", "mpipar.train", *common, "--steps", "0",
                           "--export-hf", str(tmp_path / "same"), "--run-dir", str(tmp_path / "r0")],
                          capture_output=True, text=True, timeout=120, env=launch_env())
    assert proc.returncode == 0, proc.stderr
    cfg, back = load_hf(tmp_path / "same")
    assert cfg.hidden == 48 and cfg.rope_theta == 5000.0
    assert all(back[n].dtype == np.float64 and np.array_equal(back[n], params[n]) for n in params)
    # A contradicting model flag is an error naming both values.
    bad = subprocess.run([sys.executable, "-m", "mpipar.train", *common, "--hidden", "64",
                          "--run-dir", str(tmp_path / "bad")], capture_output=True, text=True,
                         timeout=60, env=launch_env())
    assert bad.returncode == 2 and "model.hidden=64" in bad.stderr and "hidden_size=48" in bad.stderr


@needs_mpirun
@pytest.mark.parametrize("model,layout", [({}, ["--tp", "2"]), (TIED_QWEN2, ["--pp", "2"])],
                         ids=["llama-tp2", "tied-qwen2-llama3-pp2"])
def test_hf_fine_tune_is_layout_invariant(tmp_path, model, layout):
    """Two steps from a checkpoint on one process and on two ranks export the same weights (a
    tied model: one tensor, the tie across the two pipeline stages kept)."""
    import numpy as np

    from mpipar.checkpoint.huggingface import load_hf

    src, data, _ = _hf_checkpoint(tmp_path, **model)
    common = ["--init-from-hf", str(src), "--data", str(data), "--seq-len", "16", "--steps", "2",
              "--global-batch-size", "4", "--dtype", "float64", "--backend", "numpy"]
    one = subprocess.run([sys.executable, "-m", "mpipar.train", *common, "--export-hf",
                          str(tmp_path / "a"), "--run-dir", str(tmp_path / "ra")],
                         capture_output=True, text=True, timeout=120, env=launch_env())
    two = subprocess.run([*mpirun(2), sys.executable, "-m", "mpipar.train", *common, *layout,
                          "--export-hf", str(tmp_path / "b"), "--run-dir", str(tmp_path / "rb")],
                         capture_output=True, text=True, timeout=120, env=launch_env())
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    for out in ("a", "b"):
        written = json.loads((tmp_path / out / "config.json").read_text())
        assert written["tie_word_embeddings"] == bool(model)
        assert written["architectures"] == ["Qwen2ForCausalLM" if model else "LlamaForCausalLM"]
    a, b = load_hf(tmp_path / "a")[1], load_hf(tmp_path / "b")[1]
    assert ("lm_head.weight" in a) != bool(model) and a.keys() == b.keys()
    for name in a:
        assert np.abs(a[name] - b[name]).max() <= 1e-10 * np.abs(a[name]).max(), name
