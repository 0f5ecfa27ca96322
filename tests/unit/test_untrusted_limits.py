"""Sizes a flag or a file declares, bounded before anything is allocated: each case runs the
real command (in a child capped in address space where the input could make it allocate, or in
this process), and asserts exit status 2, one message naming the value and the rule, no
traceback, within seconds."""
from __future__ import annotations

import pytest

from mpipar.config import trace_step_set
from untrusted import TINY, run_bounded, run_train

T = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--seq-len", "64",
     "--global-batch-size", "4", "--backend", "numpy", "--tensorboard", "off"]


def _one_error(code, err, message) -> None:
    assert code == 2, err
    assert err.count("mpipar: error:") == 1 and message in err and "Traceback" not in err, err


# ------------------------------------------------------------------------------ --trace-steps
def test_a_range_of_trace_steps_is_held_as_a_range(tmp_path):
    code, err, seconds = run_bounded(["-c", """if True:
        from mpipar.config import trace_step_set
        steps = trace_step_set("3,10-99999999999999999999")
        assert steps.last == 99999999999999999999
        assert 3 in steps and 10**19 in steps and 4 not in steps and 10**20 not in steps"""],
        tmp_path, memory=1 << 30, timeout=60)
    assert code == 0 and seconds < 30, err


def test_trace_steps_name_the_steps_they_hold():
    assert [s for s in range(12) if s in trace_step_set("2,5-6,9")] == [2, 5, 6, 9]
    assert trace_step_set("4").last == 4 and not trace_step_set("0")


def test_a_huge_trace_range_is_refused_within_bounded_memory(tmp_path):
    code, err, seconds = run_bounded(
        ["-m", "mpipar.train", *T, "--steps", "1", "--trace-steps", "1-99999999999999999999",
         "--run-dir", str(tmp_path / "run")], tmp_path, memory=3 << 30, timeout=120)
    _one_error(code, err, "train.trace_steps='1-99999999999999999999': step "
                          "99999999999999999999 is past train.steps=1")
    assert seconds < 60 and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("spec", ["2-5", "5", "1,4", "3-3,2-4"])
def test_trace_steps_past_the_last_step_are_refused(tmp_path, spec):
    code, err = run_train([*TINY, "--trace-steps", spec, "--run-dir", str(tmp_path)])
    _one_error(code, err, f"train.trace_steps={spec!r}: step")
    assert "is past train.steps=3" in err and not (tmp_path / "trace.json").exists()


# --------------------------------------------------------------- Hugging Face expert counts
@pytest.fixture
def hf_dir(tmp_path):
    """A Hugging Face export of a small dense model (float32)."""
    import numpy as np

    from mpipar.checkpoint.huggingface import save_hf
    from mpipar.config import ModelConfig
    from mpipar.layout import resolve_model
    from mpipar.model.params import init_params
    model = resolve_model(ModelConfig(vocab_size=256, hidden=32, layers=2, heads=4, kv_heads=2,
                                      ffn_hidden=64))
    save_hf(tmp_path / "hf", model, init_params(model, 3, np.float32))
    return tmp_path / "hf"


MOE_BOMBS = [
    (dict(model_type="mixtral", architectures=["MixtralForCausalLM"],
          num_local_experts=10**12), "num_local_experts=1000000000000 must be at most 65536"),
    (dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=8,
          num_experts_per_tok=10**15), "num_experts_per_tok=1000000000000000 must be at most"),
    (dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_experts=10**10),
     "num_experts=10000000000 must be at most 65536"),
    (dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
          num_hidden_layers=10**11), "num_hidden_layers=100000000000"),
]


@pytest.mark.parametrize("fields,message", MOE_BOMBS, ids=["mixtral", "top-k", "qwen", "layers"])
def test_huge_expert_counts_are_refused_before_allocating(hf_dir, tmp_path, fields, message):
    import json
    raw = json.loads((hf_dir / "config.json").read_text())
    raw.update(fields)
    (hf_dir / "config.json").write_text(json.dumps(raw))
    code, err, seconds = run_bounded(["-m", "mpipar.hf", "convert", str(hf_dir),
                                      str(tmp_path / "out")], tmp_path, memory=2 << 30, timeout=60)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and seconds < 30 and not (tmp_path / "out").exists()
    code, err, seconds = run_bounded(["-m", "mpipar.hf", "inspect", str(hf_dir)], tmp_path,
                                     memory=2 << 30, timeout=60)
    assert code in (1, 2) and "Traceback" not in err and seconds < 30, err
