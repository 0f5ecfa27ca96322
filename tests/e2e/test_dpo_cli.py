"""DPO through python -m mpipar.train (no torch needed), full-parameter and with LoRA: a run
checkpointed after step 1 and resumed equals the uninterrupted run bit for bit (the step-2
losses, rewards and gradient norm in metrics.jsonl, the checkpoint's tensors and its recorded
reference log-probabilities)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import launch_env
from hf_export import export_small_model
from mpipar.checkpoint.reader import read_dpo_reference, read_tensors
from mpipar.data.preference import prepare_preference

TRAIN = ["--seq-len", "8", "--global-batch-size", "2", "--backend", "numpy", "--log-every", "0",
         "--dtype", "float64", "--lr-schedule", "constant", "--warmup-steps", "0", "--lr", "0.01"]
DPO = ["--objective", "dpo", "--dpo-beta", "0.5"]
LORA = ["--lora-rank", "4", "--lora-alpha", "6", "--lora-targets", "q_proj,v_proj,down_proj"]
KEYS = ("loss", "grad_norm", "dpo_reward_chosen", "dpo_reward_rejected", "dpo_accuracy")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A small float32 Hugging Face model and 4 pairs of token ids prepared for --seq-len 8."""
    root = tmp_path_factory.mktemp("dpo_cli")
    export_small_model(root / "hf")
    rng = np.random.default_rng(1)
    lines = [json.dumps({"prompt_ids": rng.integers(1, 61, 3).tolist(),
                         "chosen_ids": rng.integers(1, 61, 4).tolist(),
                         "rejected_ids": rng.integers(1, 61, 3).tolist()}) for _ in range(4)]
    (root / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    prepare_preference(root / "pairs.jsonl", root / "pairs.h5", 8)
    return root


def _train(root, run, steps, *flags):
    done = subprocess.run([sys.executable, "-m", "mpipar.train", *TRAIN, *DPO, "--data",
                           str(root / "pairs.h5"), "--init-from-hf", str(root / "hf"),
                           "--run-dir", str(root / run), "--steps", str(steps),
                           "--save-dir", str(root / f"{run}.ck"), "--save-every", "1", *flags],
                          capture_output=True, text=True, timeout=300, env=launch_env())
    assert done.returncode == 0, done.stderr
    lines = (root / run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resumed_run_equals_the_uninterrupted_one(root, lora):
    flags, tag = (LORA if lora else []), ("lora" if lora else "full")
    whole = _train(root, f"whole-{tag}", 2, *flags)
    first = _train(root, f"part-{tag}", 1, *flags)
    assert first[1]["loss"] == whole[1]["loss"]
    resumed = _train(root, f"part-{tag}", 2, "--resume", "auto", *flags)
    assert whole[2]["dpo_reward_chosen"] != 0.0                   # the policy moved
    assert [resumed[2][k] for k in KEYS] == [whole[2][k] for k in KEYS]
    step2 = "step_00000002"
    want, got = root / f"whole-{tag}.ck" / step2, root / f"part-{tag}.ck" / step2
    np.testing.assert_array_equal(read_dpo_reference(got), read_dpo_reference(want))
    assert read_dpo_reference(want).shape == (8,)
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        a, b = read_tensors(want, kind), read_tensors(got, kind)
        assert sorted(a) == sorted(b)
        for n in a:
            np.testing.assert_array_equal(b[n], a[n])


def test_resume_from_another_objectives_checkpoint_exits_2(root):
    """A next-token run's checkpoint holds no reference log-probabilities: resuming it with
    --objective dpo exits 2 naming it, rather than taking step 1's policy as the reference."""
    np.save(root / "tokens.npy", np.random.default_rng(0).integers(0, 61, size=(8, 9)))
    base = [sys.executable, "-m", "mpipar.train", *TRAIN, "--init-from-hf",
            str(root / "hf"), "--save-dir", str(root / "tokens.ck")]
    first = subprocess.run([*base, "--data", str(root / "tokens.npy"), "--run-dir",
                            str(root / "tokens"), "--steps", "1", "--save-every", "1"],
                           capture_output=True, text=True, timeout=300, env=launch_env())
    assert first.returncode == 0, first.stderr
    dpo = subprocess.run([*base, *DPO, "--data", str(root / "pairs.h5"), "--run-dir",
                          str(root / "tokens-dpo"), "--steps", "2", "--resume", "auto"],
                         capture_output=True, text=True, timeout=300, env=launch_env())
    assert dpo.returncode == 2, dpo.stderr
    assert "step_00000001: holds no DPO reference log-probabilities at step 1" in dpo.stderr
