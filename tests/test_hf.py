"""Hugging Face Llama in and out, checked against transformers in float64.

A small random ``LlamaForCausalLM`` (vocabulary 97, 6 query heads over 2 kv heads: neither a
power of two, grouped-query attention) is saved with ``save_pretrained`` and read by
:func:`mpipar.hf.load_hf`; mpipar's logits, loss and three training steps must match
transformers + ``torch.optim.AdamW`` to 1e-10 relative.

transformers is not float64 throughout, even for a float64 model (transformers 5.x source,
``models/llama/modeling_llama.py`` and ``loss/loss_utils.py``):

- ``LlamaRotaryEmbedding``: ``inv_freq`` is built with ``dtype=torch.float`` and ``forward``
  computes ``position_ids.float() * inv_freq.float()`` and its cos/sin in float32;
- ``LlamaRMSNorm.forward`` casts the hidden state ``.to(torch.float32)`` before normalising;
- ``ForCausalLMLoss`` computes the loss from ``logits.float()``.

mpipar computes all three in the working dtype (RoPE angles in float64). So the exact reference
(:func:`float64_transformers`) replaces the two module forwards by the same formulas in the
tensor's own dtype and computes the loss with ``ForCausalLMLoss``'s shift in float64; the
unpatched model is also compared and must differ at float32 round-off (1e-9 .. 1e-5 relative),
so the gap is explained rather than hidden. Attention is ``sdpa`` (float64 on CPU); the
``eager`` path would add a float32 softmax.
"""
from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch is a test-only dependency of the Hugging Face tests "
                    "(pip install torch==2.13.0)")
transformers = pytest.importorskip(
    "transformers", reason="transformers is a test-only dependency of the Hugging Face tests")
from mpi4py import MPI  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from mpipar.config import (Config, ConfigError, ModelConfig, ParallelConfig,  # noqa: E402
                           TrainConfig)
from mpipar.data import load_tokens  # noqa: E402
from mpipar.engine import Engine  # noqa: E402
from mpipar.hf import (CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, HFCheckpointError,  # noqa: E402
                       check_export_target, hf_name, load_hf, main, model_config_with_overrides,
                       mpipar_name, passthrough_config, read_model_config, save_hf)

V, H, HEADS, KV, LAYERS, FFN, THETA, EPS = 97, 48, 6, 2, 2, 80, 10000.0, 1e-6
B, S, STEPS = 2, 12, 3
OPT = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip_grad=0.5)
TOL = 1e-10


def rel(a, b) -> float:
    """max |a - b| / max |b| (the relative difference used throughout)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


# ------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A random float64 LlamaForCausalLM written by transformers' save_pretrained."""
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, num_attention_heads=HEADS,
                      num_key_value_heads=KV, num_hidden_layers=LAYERS, intermediate_size=FFN,
                      rope_theta=THETA, rms_norm_eps=EPS, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float64)
    with torch.no_grad():  # larger weights than the default init, and norms away from 1
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.15 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Path:
    """Token rows ``[STEPS * B, S + 1]``; mpipar's step k trains rows k*B .. (k+1)*B - 1."""
    path = tmp_path_factory.mktemp("data") / "samples.npy"
    np.save(path, np.random.default_rng(5).integers(0, V, size=(STEPS * B, S + 1)))
    return path


def hf_model(path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa")


def _rmsnorm_own_dtype(self, x):
    """LlamaRMSNorm.forward without the float32 cast: the same formula in x's dtype."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _rotary_float64(self, x, position_ids):
    """LlamaRotaryEmbedding.forward (rope_type default) with inv_freq and angles in float64."""
    cfg = self.config
    params = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    dim = cfg.head_dim
    with torch.no_grad():
        inv_freq = params["rope_theta"] ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


@pytest.fixture
def float64_transformers(monkeypatch):
    """transformers' Llama with RMSNorm and RoPE computed in the model dtype (see module doc)."""
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rmsnorm_own_dtype)
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", _rotary_float64)


def hf_loss_float64(logits, labels):
    """ForCausalLMLoss (pad labels with -100, shift left, mean cross-entropy) without its
    ``logits.float()``: logits ``[B, T, V]``, labels ``[B, T]`` -> scalar."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             shifted.reshape(-1), ignore_index=-100)


def mpipar_engine(model_cfg: ModelConfig, params, samples) -> Engine:
    train = TrainConfig(steps=STEPS, seq_len=S, global_batch_size=B, micro_batch_size=0,
                        lr_schedule="constant", warmup_steps=0, min_lr=0.0, dtype="float64",
                        backend="numpy", shuffle=False, seed=0, **OPT)
    cfg = Config(model_cfg, ParallelConfig(), train).resolved(1)
    engine = Engine(cfg, MPI.COMM_SELF, source=load_tokens(str(samples), V, S))
    engine.load_params(params)
    return engine


def mpipar_logits(engine: Engine, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token logits ``[B, S, V]`` and losses ``[B, S]`` of ``rows`` ``[B, S + 1]``."""
    stage = engine.chunks[0]
    loss, cache = stage.forward(engine.params, rows[:, :-1], engine.positions, rows[:, 1:])
    logits = cache.head.logits  # [B*S, V]: the LM head's output, kept for the backward
    return logits.reshape(rows.shape[0], S, V), loss


# ------------------------------------------------------------------------- 1. logits
def test_import_config_and_dtype(hf_dir):
    cfg, params = load_hf(hf_dir)
    assert cfg == ModelConfig(vocab_size=V, hidden=H, layers=LAYERS, heads=HEADS, kv_heads=KV,
                              head_dim=H // HEADS, ffn_hidden=FFN, rope_theta=THETA,
                              norm_eps=EPS, init_std=0.02)
    assert {p.dtype for p in params.values()} == {np.dtype(np.float64)}
    ref = hf_model(hf_dir).state_dict()
    for name, value in params.items():
        np.testing.assert_array_equal(value, ref[hf_name(name)].numpy())
    _, cast = load_hf(hf_dir, dtype="float32")
    assert {p.dtype for p in cast.values()} == {np.dtype(np.float32)}


def test_logits_and_loss_match_transformers(hf_dir, samples, monkeypatch):
    cfg, params = load_hf(hf_dir)
    rows = np.load(samples)[:B]
    ids = torch.from_numpy(rows)
    got, token_loss = mpipar_logits(mpipar_engine(cfg, params, samples), rows)

    model = hf_model(hf_dir)
    with torch.no_grad():
        plain = model(input_ids=ids, labels=ids)
    err_plain = rel(got, plain.logits[:, :S].numpy())
    loss_plain = abs(token_loss.mean() - plain.loss.item()) / plain.loss.item()

    partial = {}  # each float32 cast alone leaves a float32-sized gap: both patches are needed
    for cls, forward in ((modeling_llama.LlamaRotaryEmbedding, _rotary_float64),
                         (modeling_llama.LlamaRMSNorm, _rmsnorm_own_dtype)):
        with monkeypatch.context() as patch:
            patch.setattr(cls, "forward", forward)
            with torch.no_grad():
                logits = model(input_ids=ids).logits[:, :S].numpy()
            partial[f"only {cls.__name__} patched"] = rel(got, logits)
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rmsnorm_own_dtype)
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", _rotary_float64)
    with torch.no_grad():
        exact = model(input_ids=ids).logits
    want_loss = hf_loss_float64(exact, ids).item()
    err = rel(got, exact[:, :S].numpy())
    err_loss = abs(token_loss.mean() - want_loss) / want_loss
    print(f"\nlogits rel diff: float64 reference {err:.2e}, transformers as shipped {err_plain:.2e}"
          f"\nloss rel diff:   float64 reference {err_loss:.2e}, transformers as shipped "
          f"{loss_plain:.2e}\nlogits rel diff with one patch: "
          + ", ".join(f"{k} {v:.2e}" for k, v in partial.items()))
    assert err <= TOL and err_loss <= TOL
    # transformers as shipped: RoPE, RMSNorm and loss in float32 -> float32 round-off, no more.
    assert 1e-9 < err_plain < 1e-5
    assert all(1e-9 < v < 1e-5 for v in partial.values()), partial
    assert loss_plain < 1e-6
    assert token_loss.mean() > 1.0  # random weights: far from a trivial loss


# --------------------------------------------------------------------- 2. training
def test_training_matches_torch_adamw(hf_dir, samples, float64_transformers, tmp_path):
    cfg, params = load_hf(hf_dir)
    engine = mpipar_engine(cfg, params, samples)
    results = [engine.train_step(k) for k in range(STEPS)]
    trained = engine.gather_params()

    model = hf_model(hf_dir)
    model.train()
    named = dict(model.named_parameters())
    decay = [p for p in named.values() if p.ndim >= 2]
    no_decay = [p for p in named.values() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": OPT["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=OPT["lr"],
                            betas=(OPT["beta1"], OPT["beta2"]), eps=OPT["eps"])
    rows = torch.from_numpy(np.load(samples))
    losses, norms = [], []
    for k in range(STEPS):
        ids = rows[k * B:(k + 1) * B]
        opt.zero_grad()
        loss = hf_loss_float64(model(input_ids=ids).logits, ids)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), OPT["clip_grad"]).item())
        opt.step()
        losses.append(loss.item())

    assert norms[0] > OPT["clip_grad"]  # clipping is exercised
    for k, r in enumerate(results):
        assert abs(r.loss - losses[k]) <= TOL * losses[k], (k, r.loss, losses[k])
        assert abs(r.grad_norm - norms[k]) <= TOL * norms[k], (k, r.grad_norm, norms[k])
    errs = {n: rel(v, named[hf_name(n)].detach().numpy()) for n, v in trained.items()}
    moved = max(rel(trained[n], params[n]) for n in trained)
    print(f"\nafter {STEPS} steps: max param rel diff {max(errs.values()):.2e} (params moved by "
          f"up to {moved:.2e}); loss diffs "
          f"{[f'{abs(r.loss - l) / l:.1e}' for r, l in zip(results, losses)]}")
    assert max(errs.values()) <= TOL, sorted(errs.items(), key=lambda kv: -kv[1])[:3]
    assert moved > 1e-3

    # --export-hf: the trained float64 weights load into transformers unchanged.
    save_hf(tmp_path / "trained", cfg, trained)
    reloaded = hf_model(tmp_path / "trained").state_dict()
    for name, value in trained.items():
        np.testing.assert_array_equal(reloaded[hf_name(name)].numpy(), value)


# ------------------------------------------------------------------- 3. round trip
class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_round_trip_and_transformers_loads_export(hf_dir, tmp_path):
    cfg, params = load_hf(hf_dir)
    out = tmp_path / "export"
    save_hf(out, cfg, params, extra_config=passthrough_config(hf_dir))
    assert sorted(os.listdir(out)) == [CONFIG_FILE, WEIGHTS_FILE]
    written = json.loads((out / CONFIG_FILE).read_text())
    assert written["dtype"] == written["torch_dtype"] == "float64"
    assert written["tie_word_embeddings"] is False
    assert written["rope_theta"] == written["rope_parameters"]["rope_theta"] == THETA
    assert (written["bos_token_id"], written["eos_token_id"]) == (1, 2)  # carried over
    cfg2, params2 = load_hf(out)
    assert cfg2 == cfg and params2.keys() == params.keys()
    for name, value in params.items():
        assert params2[name].dtype == np.float64
        np.testing.assert_array_equal(params2[name], value)

    records = _Records()
    root = logging.getLogger("transformers")
    root.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True,
                                                           dtype="auto")
    finally:
        root.removeHandler(records)
    assert all(not v for v in info.values()), info  # missing, unexpected, mismatched, errors
    noise = [m for m in records.messages + [str(w.message) for w in caught]
             if any(word in m.lower() for word in ("missing", "unexpected", "not used", "report",
                                                    "newly initialized", "not initialized"))]
    assert not noise, noise
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    original = hf_model(hf_dir).state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, original[name], rtol=0, atol=0)


def test_export_dtype_and_replacement(hf_dir, tmp_path):
    cfg, params = load_hf(hf_dir)
    out = tmp_path / "f32"
    save_hf(out, cfg, params, dtype="float32")
    assert json.loads((out / CONFIG_FILE).read_text())["dtype"] == "float32"
    _, p32 = load_hf(out)
    for name, value in params.items():
        np.testing.assert_array_equal(p32[name], value.astype(np.float32))
    save_hf(out, cfg, params)  # a previous export is replaced atomically
    assert load_hf(out)[1]["norm.weight"].dtype == np.float64
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no temp dirs left
    (out / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json"):
        save_hf(out, cfg, params)
    with pytest.raises(ValueError, match="tokenizer.json"):
        check_export_target(out)
    with pytest.raises(ValueError, match="dtype='int8'"):
        save_hf(tmp_path / "bad", cfg, params, dtype="int8")
    with pytest.raises(ValueError, match="only"):
        save_hf(tmp_path / "bad", cfg, params, extra_config={"hidden_size": 3})
    with pytest.raises(ValueError, match="missing"):
        save_hf(tmp_path / "bad", cfg, {k: v for k, v in params.items() if k != "norm.weight"})
    assert not (tmp_path / "bad").exists()


# --------------------------------------------------- 4. shards, config styles, refusals
def _copy_with_config(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint ``src`` whose config.json is ``edit(dict)``'s result."""
    dst.mkdir()
    (dst / WEIGHTS_FILE).write_bytes((src / WEIGHTS_FILE).read_bytes())
    raw = json.loads((src / CONFIG_FILE).read_text())
    (dst / CONFIG_FILE).write_text(json.dumps(edit(raw)))
    return dst


def test_sharded_checkpoint(hf_dir, tmp_path):
    _, params = load_hf(hf_dir)
    tensors = {hf_name(n): v for n, v in params.items()}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    out = tmp_path / "sharded"
    out.mkdir()
    (out / CONFIG_FILE).write_text((hf_dir / CONFIG_FILE).read_text())
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(out / file), metadata={"format": "pt"})
    weight_map = {n: f for f, part in shards.items() for n in part}
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _, got = load_hf(out)
    for name, value in params.items():
        np.testing.assert_array_equal(got[name], value)
    weight_map[names[0]] = "model-00002-of-00002.safetensors"  # listed in the wrong shard
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(HFCheckpointError, match="not stored in this shard"):
        load_hf(out)


def _v4_style(raw):
    raw = dict(raw, rope_theta=500000.0, rope_scaling=None, torch_dtype=raw["dtype"])
    del raw["rope_parameters"], raw["dtype"]
    return raw


def _v5_style(raw):
    return dict(raw, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})


@pytest.mark.parametrize("edit", [_v4_style, _v5_style], ids=["transformers4", "transformers5"])
def test_config_styles(hf_dir, tmp_path, edit):
    cfg, _ = load_hf(_copy_with_config(hf_dir, tmp_path / "c", edit))
    assert cfg.rope_theta == 500000.0 and cfg.kv_heads == KV and cfg.norm_eps == EPS


REFUSALS = {
    "architecture": (lambda r: dict(r, architectures=["MistralForCausalLM"]), "architectures"),
    "model_type": (lambda r: dict(r, model_type="mistral"), "model_type='mistral'"),
    "rope_scaling": (lambda r: dict(r, rope_scaling={"rope_type": "llama3", "factor": 8.0}),
                     "rope_scaling.rope_type='llama3'"),
    "rope_scaling_v4_type": (lambda r: dict(r, rope_scaling={"type": "linear", "factor": 2.0}),
                             "rope_scaling.rope_type='linear'"),
    "rope_parameters": (lambda r: dict(r, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                           "rope_theta": 1e4}),
                        "rope_parameters.rope_type='yarn'"),
    "rope_theta_conflict": (lambda r: dict(r, rope_theta=5.0), "rope_theta=5.0 contradicts"),
    "attention_bias": (lambda r: dict(r, attention_bias=True), "attention_bias=True"),
    "mlp_bias": (lambda r: dict(r, mlp_bias=True), "mlp_bias=True"),
    "hidden_act": (lambda r: dict(r, hidden_act="gelu"), "hidden_act='gelu'"),
    "tied": (lambda r: dict(r, tie_word_embeddings=True), "tie_word_embeddings"),
    "kv_heads": (lambda r: dict(r, num_key_value_heads=4), "num_key_value_heads=4"),
    "missing_field": (lambda r: {k: v for k, v in r.items() if k != "vocab_size"}, "vocab_size"),
    "shape": (lambda r: dict(r, intermediate_size=64),
              r"mlp.gate_proj.weight has shape \[80, 48\], config.json implies \[64, 48\]"),
    "missing_tensors": (lambda r: dict(r, num_hidden_layers=3), "9 missing tensor"),
    "unexpected_tensors": (lambda r: dict(r, num_hidden_layers=1), "9 unexpected tensor"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals(hf_dir, tmp_path, case):
    edit, message = REFUSALS[case]
    path = _copy_with_config(hf_dir, tmp_path / "c", edit)
    with pytest.raises(HFCheckpointError, match=message):
        load_hf(path)


def test_unexpected_bias_and_missing_files(hf_dir, tmp_path):
    _, params = load_hf(hf_dir)
    tensors = {hf_name(n): v for n, v in params.items()}
    out = tmp_path / "bias"
    out.mkdir()
    (out / CONFIG_FILE).write_text((hf_dir / CONFIG_FILE).read_text())
    save_file(dict(tensors, **{"model.layers.0.self_attn.q_proj.bias": np.zeros(H)}),
              str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    with pytest.raises(HFCheckpointError, match="1 unexpected tensor.*q_proj.bias"):
        load_hf(out)
    (out / WEIGHTS_FILE).unlink()
    with pytest.raises(HFCheckpointError, match="no model.safetensors and no"):
        load_hf(out)
    with pytest.raises(HFCheckpointError, match="config.json: file not found"):
        load_hf(tmp_path)


def test_tied_embeddings_untied_on_request(hf_dir, tmp_path):
    _, params = load_hf(hf_dir)
    out = tmp_path / "tied"
    out.mkdir()
    raw = json.loads((hf_dir / CONFIG_FILE).read_text())
    (out / CONFIG_FILE).write_text(json.dumps(dict(raw, tie_word_embeddings=True)))
    save_file({hf_name(n): v for n, v in params.items() if n != "lm_head.weight"},
              str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    with pytest.raises(HFCheckpointError, match="tie_word_embeddings"):
        read_model_config(out)
    _, got = load_hf(out, untie_embeddings=True)
    np.testing.assert_array_equal(got["lm_head.weight"], params["embed_tokens.weight"])
    assert got["lm_head.weight"] is not got["embed_tokens.weight"]


def test_bfloat16_widened_exactly(tmp_path, hf_dir):
    from safetensors.torch import save_file as save_torch
    model = hf_model(hf_dir).to(torch.bfloat16)
    out = tmp_path / "bf16"
    out.mkdir()
    (out / CONFIG_FILE).write_text((hf_dir / CONFIG_FILE).read_text())
    save_torch({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / WEIGHTS_FILE),
               metadata={"format": "pt"})
    _, got = load_hf(out)
    _, got64 = load_hf(out, dtype="float64")
    for name, value in model.state_dict().items():
        want = value.float().numpy()
        name = mpipar_name(name)
        assert got[name].dtype == np.float32 and got64[name].dtype == np.float64
        np.testing.assert_array_equal(got[name], want)
        np.testing.assert_array_equal(got64[name], want.astype(np.float64))


# ------------------------------------------------------------ CLI helper and commands
def test_overrides_from_the_command_line(hf_dir):
    hf_cfg = read_model_config(hf_dir)
    same = model_config_with_overrides(hf_cfg, {"hidden": H, "heads": HEADS, "head_dim": 0,
                                                "layers": None, "init_std": 0.5})
    assert same.hidden == H and same.init_std == 0.5 and same.ffn_hidden == FFN
    with pytest.raises(ConfigError, match=r"model.hidden=64 .*--hidden.*hidden_size=48"):
        model_config_with_overrides(hf_cfg, {"hidden": 64}, source=str(hf_dir))
    with pytest.raises(ConfigError, match="model.rope_theta=500.0"):
        model_config_with_overrides(hf_cfg, {"rope_theta": 500.0})
    with pytest.raises(ConfigError, match="model.ffn_hidden=0"):  # 0 derives 8/3*hidden = 128
        model_config_with_overrides(hf_cfg, {"ffn_hidden": 0})
    with pytest.raises(ConfigError, match="do not exist"):
        model_config_with_overrides(hf_cfg, {"width": 3})


def test_cli_inspect_and_convert(hf_dir, tmp_path, capsys):
    assert main(["inspect", str(hf_dir)]) == 0
    text = capsys.readouterr().out
    assert "model.layers.1.mlp.down_proj.weight" in text and "[48, 80]" in text
    assert "F64" in text and f"kv_heads = {KV}" in text
    assert main(["convert", str(hf_dir), str(tmp_path / "f32"), "--dtype", "float32"]) == 0
    _, params = load_hf(hf_dir)
    _, got = load_hf(tmp_path / "f32")
    for name, value in params.items():
        np.testing.assert_array_equal(got[name], value.astype(np.float32))
    bad = _copy_with_config(hf_dir, tmp_path / "bad", lambda r: dict(r, mlp_bias=True))
    assert main(["inspect", str(bad)]) == 1
    assert "mlp_bias=True" in capsys.readouterr().out
    assert main(["convert", str(bad), str(tmp_path / "x")]) == 2
    assert "mlp_bias=True" in capsys.readouterr().err
