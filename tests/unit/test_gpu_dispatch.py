"""The GPU backend's choices, on the host: which bf16 attention backend a model gets and why
(``kernels.gpu_bf16.attention_choice``), the per-call fallback of ``auto``, and the routing of a
call by the dtype of its first array. The kernels themselves are faked: nothing here needs CuPy
or a device (tests/gpu runs the real ones)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mpipar.kernels import cudnn_attention, flash_mma, gpu_bf16


@pytest.fixture
def backends(monkeypatch):
    """Set what cuDNN and mpipar's kernel say about a case: None (takes it) or a reason."""
    said = {"cudnn": None, "mpipar": None}
    monkeypatch.setattr(cudnn_attention, "supports", lambda *a, **k: said["cudnn"])
    monkeypatch.setattr(flash_mma, "supports", lambda *a, **k: said["mpipar"])
    return said


def test_auto_takes_cudnn_where_it_can_and_says_why_when_it_cannot(backends):
    got = gpu_bf16.attention_choice("auto", head_dim=128)
    assert got.backend == "cudnn" and "takes the model's attention" in got.describe()
    backends["cudnn"] = "cudnn is not importable (ModuleNotFoundError)"
    got = gpu_bf16.attention_choice("auto", head_dim=128)
    assert got.backend == "mpipar"
    assert got.describe() == ("attention: mpipar (cuDNN not used: cudnn is not importable "
                              "(ModuleNotFoundError))")


def test_an_explicit_choice_that_cannot_run_is_refused_with_the_reason(backends):
    backends["cudnn"] = "the cuDNN attention backend takes bfloat16 only"
    with pytest.raises(ValueError, match="attention backend 'cudnn': the cuDNN attention"):
        gpu_bf16.attention_choice("cudnn", head_dim=128)
    backends["mpipar"] = "flash_mma: head_dim=48 is not one of (32, 64, 96, 128)"
    with pytest.raises(ValueError, match="attention backend 'mpipar': flash_mma: head_dim=48"):
        gpu_bf16.attention_choice("mpipar", head_dim=48)
    with pytest.raises(ValueError, match="no bf16 attention kernel.*cuDNN.*mpipar"):
        gpu_bf16.attention_choice("auto", head_dim=48)
    with pytest.raises(ValueError, match="must be one of auto, cudnn, mpipar"):
        gpu_bf16.attention_choice("flash3", head_dim=128)


def test_auto_sends_a_case_cudnn_refuses_to_mpipars_kernel(backends, monkeypatch):
    calls = []
    monkeypatch.setattr(cudnn_attention, "attention_fwd", lambda *a: calls.append("cudnn"))
    monkeypatch.setattr(flash_mma, "attention_fwd", lambda *a: calls.append("mpipar"))
    q = np.zeros((1, 8, 2, 64), ml_dtypes.bfloat16)
    fwd, _ = gpu_bf16.attention_ops(gpu_bf16.attention_choice("auto", head_dim=64))
    fwd(q, q, q)
    backends["cudnn"] = "a mask cuDNN cannot express"
    fwd(q, q, q)
    assert calls == ["cudnn", "mpipar"]
    backends["cudnn"] = None                            # asked for: always cuDNN, no fallback
    fwd, _ = gpu_bf16.attention_ops(gpu_bf16.attention_choice("cudnn", head_dim=64))
    backends["cudnn"] = "a mask cuDNN cannot express"
    fwd(q, q, q)
    assert calls == ["cudnn", "mpipar", "cudnn"]


def test_a_call_is_routed_by_the_dtype_of_its_first_array():
    op = gpu_bf16.by_dtype(lambda x, y=0: ("float", x.dtype), lambda x, y=0: ("bf16", x.dtype))
    assert op(np.zeros(2, np.float32))[0] == "float"
    assert op(np.zeros(2, np.float64), y=1)[0] == "float"
    assert op(np.zeros(2, ml_dtypes.bfloat16))[0] == "bf16"
    assert op(x=np.zeros(2, ml_dtypes.bfloat16))[0] == "bf16"


def test_the_embedding_gradient_is_routed_by_its_bf16_rows_not_its_float32_buffer():
    position, name = gpu_bf16.ROUTED_BY["embedding_bwd"]
    op = gpu_bf16.by_dtype(lambda dw, dx, ids, row_start=0: "float",
                           lambda dw, dx, ids, row_start=0: "bf16", position, name)
    dw, ids = np.zeros((4, 2), np.float32), np.zeros(3, np.int64)
    assert op(dw, np.zeros((3, 2), ml_dtypes.bfloat16), ids) == "bf16"
    assert op(dw, dx=np.zeros((3, 2), ml_dtypes.bfloat16), ids=ids) == "bf16"
    assert op(dw, np.zeros((3, 2), np.float32), ids) == "float"


# ----------------------------------------------------------------- --attention-backend
def _layout(**train):
    from mpipar.config import Config
    from mpipar.layout import resolve

    cfg = Config()
    cfg.model.layers, cfg.model.hidden, cfg.model.heads, cfg.model.kv_heads = 2, 64, 2, 1
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return resolve(cfg, 1)   # the layout's numbers, without the device's rules


def test_an_explicit_attention_backend_off_a_gpu_or_outside_bf16_exits_2(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "mpipar.train", "--attention-backend", "mpipar",
                           "--steps", "1", "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("train.attention_backend='mpipar' chooses the bf16 attention of "
                             "a CUDA device; this run computes in float32 on cpu") == 1
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_the_attention_rule_asks_the_chosen_backend_about_each_window(backends):
    from mpipar.config import ConfigError
    from mpipar.runtime.device import check_attention

    layout = _layout(attention_backend="cudnn", dtype="bfloat16")
    check_attention(layout, "cuda")                       # both take the case: no error
    backends["cudnn"] = "cuDNN 9.19 refuses head_dim 32"
    with pytest.raises(ConfigError, match=r"train.attention_backend='cudnn' for head_dim 32, "
                                          r"window 0: attention backend 'cudnn': cuDNN 9.19"):
        check_attention(layout, "cuda")
    check_attention(_layout(attention_backend="mpipar", dtype="bfloat16"), "cuda")
    check_attention(_layout(dtype="bfloat16"), "cuda")    # auto: the choice is made per call


def test_cudnn_asked_for_with_document_masking_is_refused(backends):
    """One-token documents make blocks of one query and one key, which cuDNN's backward refuses
    (measured on an H200): asked for explicitly with --document-masking it is refused up front;
    auto sends those blocks to mpipar's kernel."""
    from mpipar.config import ConfigError
    from mpipar.runtime.device import check_attention

    docs = dict(dtype="bfloat16", document_masking=True, eos_token_id=0)
    with pytest.raises(ConfigError, match=r"train.attention_backend='cudnn' with "
                                          r"--document-masking: a one-token document"):
        check_attention(_layout(attention_backend="cudnn", **docs), "cuda")
    check_attention(_layout(**docs), "cuda")
    check_attention(_layout(attention_backend="mpipar", **docs), "cuda")


def test_the_cpu_run_names_its_attention_kernels():
    from mpipar.config import ModelConfig
    from mpipar.kernels import get_backend
    from mpipar.runtime.device import attention_kernels

    kernels, line = attention_kernels(get_backend("numpy"), "auto", ModelConfig(head_dim=32))
    assert kernels is get_backend("numpy") and line == "attention: numpy kernels"
