"""Hugging Face Llama, Qwen2, Qwen3 and Mistral in and out, checked against transformers in float64, in
one process.

Small random models (vocabulary 97, 6 query heads over 2 kv heads: neither a power of
two, grouped-query attention) are saved with ``save_pretrained`` and read by
:func:`mpipar.checkpoint.huggingface.load_hf` (:data:`transformers_reference.MODELS`): a plain
``LlamaForCausalLM``; one with Llama 3.1's ``llama3`` RoPE scaling and tied embeddings; a
``Qwen2ForCausalLM`` (q/k/v biases); a ``Qwen3ForCausalLM`` (per-head q/k norms, its own head
dim); a ``MistralForCausalLM`` with a sliding window shorter than
the sequence. mpipar's logits, loss and three training steps must match transformers +
``torch.optim.AdamW`` to 1e-10 relative; so must the exported parameters. The ``linear`` and
``dynamic`` RoPE rules are compared on logits, and so is ``yarn`` (a Qwen3 with a long-context
yarn config). Why the reference removes transformers' float32
casts, and how: :mod:`transformers_reference`. Layouts with PP, TP, SP and ZeRO-1:
mpi/test_hf.py."""
from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

# First: importing transformers_reference skips this module where torch or transformers is
# missing. float64_transformers, hf_dirs and samples are fixtures.
from transformers_reference import (B, EPS, FFN, H, HEADS, KV, LAYERS, LLAMA3, MODELS,  # noqa: F401
                                    OPT, PATCHES, S, STEPS, THETA, TOL, V, YARN,
                                    float64_transformers,
                                    hf_dirs, hf_loss, hf_model, mpipar_rank, rel, samples,
                                    torch, torch_training, training_differences)
from safetensors import safe_open
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM
from transformers.models.mistral import modeling_mistral

from mpipar.checkpoint.huggingface import (CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE,
                                           HFCheckpointError, check_export_target, hf_name,
                                           load_hf, model_config_with_overrides, mpipar_name,
                                           passthrough_config, read_model_config, save_hf)
from mpipar.config import ConfigError, ModelConfig
from mpipar.hf import main
from mpipar.training import step as trainer
from mpipar.training.rank import Rank, build_rank

TRAINED = ("llama", "llama3-tied", "qwen2", "mistral")


@pytest.fixture(scope="module")
def hf_dir(hf_dirs) -> Path:
    """The plain Llama."""
    return hf_dirs["llama"]


def _module_of(owner) -> str:
    return owner.__name__ if isinstance(owner, type(modeling_mistral)) else owner.__module__


def mpipar_logits(rank: Rank, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token logits ``[B, S, V]`` and losses ``[B, S]`` of ``rows`` ``[B, S + 1]``."""
    stage = rank.model.chunks[0]
    loss, cache = stage.forward(rank.params, rows[:, :-1], rank.model.positions, rows[:, 1:])
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


def test_import_of_scaled_tied_and_biased_models(hf_dirs):
    """What each test checkpoint becomes: RoPE scaling fields, one embedding, q/k/v biases."""
    got = {kind: load_hf(path) for kind, path in hf_dirs.items()}
    cfg, params = got["llama3-tied"]
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
            cfg.rope_original_max_positions, cfg.tie_embeddings) == ("llama3", 4, 1, 4, 8, True)
    assert "lm_head.weight" not in params and not cfg.attention_bias
    cfg, params = got["qwen2"]
    assert cfg.attention_bias and not cfg.tie_embeddings and cfg.rope_type == "default"
    assert params["layers.1.self_attn.k_proj.bias"].shape == (KV * H // HEADS,)
    assert got["linear"][0].rope_type == "linear" and got["linear"][0].rope_factor == 3.0
    cfg = got["dynamic"][0]
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_positions) == ("dynamic", 2, 8)
    cfg = got["qwen3-yarn"][0]
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_positions, cfg.rope_beta_fast,
            cfg.rope_beta_slow, cfg.rope_mscale, cfg.qk_norm) == ("yarn", 4, 4096, 32, 1, 0, True)
    for kind, (_, params) in got.items():
        ref = hf_model(hf_dirs[kind]).state_dict()
        for name, value in params.items():
            np.testing.assert_array_equal(value, ref[hf_name(name)].numpy())


@pytest.mark.parametrize("kind", list(MODELS))
def test_logits_and_loss_match_transformers(hf_dirs, kind, samples, monkeypatch):
    cfg, params = load_hf(hf_dirs[kind])
    rows = np.load(samples)[:B]
    ids = torch.from_numpy(rows)
    got, token_loss = mpipar_logits(mpipar_rank(cfg, params, samples), rows)

    model = hf_model(hf_dirs[kind])
    with torch.no_grad():
        plain = model(input_ids=ids[:, :S]).logits
    err_plain = rel(got, plain.numpy())
    shipped_loss = hf_loss(plain.float(), ids).item()
    loss_plain = abs(token_loss.mean() - shipped_loss) / shipped_loss

    partial = {}  # each float32 cast alone leaves a float32-sized gap: every patch is needed
    mine = [p for p in PATCHES if _module_of(p[0]) == type(model).__module__]
    for owner, attr, replacement in mine:
        with monkeypatch.context() as patch:
            patch.setattr(owner, attr, replacement)
            with torch.no_grad():
                logits = model(input_ids=ids[:, :S]).logits.numpy()
            partial[f"only {replacement.__name__} patched"] = rel(got, logits)
    for owner, attr, replacement in PATCHES:
        monkeypatch.setattr(owner, attr, replacement)
    with torch.no_grad():
        exact = model(input_ids=ids[:, :S]).logits
    want_loss = hf_loss(exact, ids).item()
    err = rel(got, exact.numpy())
    err_loss = abs(token_loss.mean() - want_loss) / want_loss
    print(f"\n{kind}: logits rel diff: float64 reference {err:.2e}, transformers as shipped "
          f"{err_plain:.2e}\nloss rel diff:   float64 reference {err_loss:.2e}, transformers as "
          f"shipped {loss_plain:.2e}\nlogits rel diff with one patch: "
          + ", ".join(f"{k} {v:.2e}" for k, v in partial.items()))
    assert err <= TOL and err_loss <= TOL
    # transformers as shipped: RoPE, RMSNorm and loss in float32 -> float32 round-off, no more
    # (a RoPE rule that differed from transformers' would differ by far more).
    assert 1e-9 < err_plain < 1e-5
    assert len(partial) == (3 if kind == "mistral" else 2), partial
    assert all(1e-9 < v < 1e-5 for v in partial.values()), partial
    assert loss_plain < 1e-6
    assert token_loss.mean() > 1.0  # random weights: far from a trivial loss
    if cfg.sliding_window:  # the window matters: full causal attention is far from transformers
        full = ModelConfig(**{**cfg.__dict__, "sliding_window": 0})
        assert rel(mpipar_logits(mpipar_rank(full, params, samples), rows)[0], exact.numpy()) > 1e-3


# --------------------------------------------------------------------- 2. training
@pytest.mark.parametrize("kind", TRAINED)
def test_training_matches_torch_adamw(hf_dirs, kind, samples, float64_transformers, tmp_path):
    cfg, params = load_hf(hf_dirs[kind])
    rank = mpipar_rank(cfg, params, samples)
    results = [trainer.train_step(rank, k) for k in range(STEPS)]
    trained = trainer.gather_params(rank)
    want = torch_training(hf_dirs[kind], samples)

    assert want[1][0] > OPT["clip_grad"]  # clipping is exercised
    loss_diffs, param_diff = training_differences(results, trained, want)
    moved = max(rel(trained[n], params[n]) for n in trained)
    print(f"\n{kind} after {STEPS} steps: max param rel diff {param_diff:.2e} (params moved by "
          f"up to {moved:.2e}); loss diffs {[f'{d:.1e}' for d in loss_diffs]}")
    assert max(loss_diffs) <= TOL and param_diff <= TOL
    assert moved > 1e-3

    # --export-hf: the trained float64 weights load into transformers unchanged (tied: once).
    save_hf(tmp_path / "trained", cfg, trained)
    with safe_open(str(tmp_path / "trained" / WEIGHTS_FILE), framework="np") as f:
        assert ("lm_head.weight" in f.keys()) != cfg.tie_embeddings
    reloaded = hf_model(tmp_path / "trained")
    assert type(reloaded).__name__ == hf_model(hf_dirs[kind]).__class__.__name__
    state = reloaded.state_dict()
    for name, value in trained.items():
        np.testing.assert_array_equal(state[hf_name(name)].numpy(), value)
    if cfg.tie_embeddings:
        assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()


# ------------------------------------------------------------------- 3. round trip
class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("kind", list(MODELS))
def test_round_trip_and_transformers_loads_export(hf_dirs, kind, tmp_path):
    hf_dir = hf_dirs[kind]
    cfg, params = load_hf(hf_dir)
    out = tmp_path / "export"
    save_hf(out, cfg, params, extra_config=passthrough_config(hf_dir))
    assert sorted(os.listdir(out)) == [CONFIG_FILE, WEIGHTS_FILE]
    written = json.loads((out / CONFIG_FILE).read_text())
    original = json.loads((hf_dir / CONFIG_FILE).read_text())
    assert written["dtype"] == written["torch_dtype"] == "float64"
    for key in ("architectures", "model_type", "tie_word_embeddings", "rope_parameters",
                "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert written[key] == original[key], key  # the model as it was, tokens carried over
    assert written["rope_theta"] == written["rope_parameters"]["rope_theta"] == THETA
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
            model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True,
                                                               dtype="auto")
    finally:
        root.removeHandler(records)
    assert all(not v for v in info.values()), info  # missing, unexpected, mismatched, errors
    noise = [m for m in records.messages + [str(w.message) for w in caught]
             if any(word in m.lower() for word in ("missing", "unexpected", "not used", "report",
                                                    "newly initialized", "not initialized"))]
    assert not noise, noise
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert type(model) is type(hf_model(hf_dir))
    state = hf_model(hf_dir).state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0)


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


def _v4_llama31(raw):
    """Llama 3.1/3.2's config.json as transformers 4.x wrote it (original context on top)."""
    raw = dict(_v4_style(raw), max_position_embeddings=131072,
               rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"})
    return raw


def _v4_dynamic_type(raw):
    return dict(_v4_style(raw), rope_scaling={"type": "dynamic", "factor": 2.0},
                max_position_embeddings=1024)


@pytest.mark.parametrize("edit", [_v4_style, _v5_style, _v4_llama31, _v4_dynamic_type],
                         ids=["transformers4", "transformers5", "llama3.1", "v4-type-dynamic"])
def test_config_styles(hf_dir, tmp_path, edit):
    cfg, _ = load_hf(_copy_with_config(hf_dir, tmp_path / "c", edit))
    assert cfg.rope_theta == 500000.0 and cfg.kv_heads == KV and cfg.norm_eps == EPS
    want = {_v4_llama31: ("llama3", 8.0, 8192), _v4_dynamic_type: ("dynamic", 2.0, 1024)}
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_positions) == \
        want.get(edit, ("default", 1.0, 0))


REFUSALS = {
    "architecture": (lambda r: dict(r, architectures=["MistralForCausalLM"]), "architectures"),
    "model_type": (lambda r: dict(r, model_type="gemma"), "model_type='gemma'"),
    "qwen2_type_llama_arch": (lambda r: dict(r, model_type="qwen2"),
                              r"architectures=\['LlamaForCausalLM'\] is not supported for "
                              r"model_type 'qwen2'"),
    "rope_scaling": (lambda r: dict(r, rope_scaling={"rope_type": "longrope", "factor": 8.0}),
                     "rope_scaling.rope_type='longrope' is not supported; mpipar implements "
                     "'default', 'linear', 'dynamic', 'llama3', 'yarn'"),
    "rope_scaling_v4_type": (lambda r: dict(r, rope_scaling={"type": "su", "factor": 2.0}),
                             "rope_scaling.rope_type='su'"),
    "rope_parameters": (lambda r: dict(r, rope_parameters={"rope_type": "longrope", "factor": 4.0,
                                                           "rope_theta": 1e4}),
                        "rope_parameters.rope_type='longrope'"),
    "yarn_without_context": (lambda r: dict(r, rope_scaling={"type": "yarn", "factor": 8.0}),
                             "rope_scaling.original_max_position_embeddings is missing"),
    "yarn_factor": (lambda r: dict(r, rope_parameters=dict(YARN, factor=0)),
                    r"rope_parameters.factor=0 must be a positive number"),
    "yarn_betas": (lambda r: dict(r, rope_scaling=dict(YARN, beta_fast=2, beta_slow=2)),
                   "rope_scaling.beta_fast=2 must be above beta_slow=2"),
    "yarn_attention_factor": (lambda r: dict(r, rope_scaling=dict(YARN, attention_factor=1.5)),
                              "rope_scaling.attention_factor=1.5 is not supported"),
    "llama3_without_factors": (lambda r: dict(r, rope_scaling={"rope_type": "llama3",
                                                               "factor": 8.0}),
                               "rope_scaling.low_freq_factor is missing"),
    "llama3_bounds": (lambda r: dict(r, rope_scaling=dict(LLAMA3, low_freq_factor=4.0)),
                      "low_freq_factor=4.0 must be below high_freq_factor=4.0"),
    "linear_without_factor": (lambda r: dict(r, rope_scaling={"rope_type": "linear"}),
                              "rope_scaling.factor is missing"),
    "rope_theta_conflict": (lambda r: dict(r, rope_theta=5.0), "rope_theta=5.0 contradicts"),
    "attention_bias": (lambda r: dict(r, attention_bias=True),
                       "attention_bias=true is not supported: in LlamaForCausalLM it also gives "
                       "o_proj a bias"),
    "mlp_bias": (lambda r: dict(r, mlp_bias=True), "mlp_bias=True"),
    "hidden_act": (lambda r: dict(r, hidden_act="gelu"), "hidden_act='gelu'"),
    "kv_heads": (lambda r: dict(r, num_key_value_heads=4), "num_key_value_heads=4"),
    "missing_field": (lambda r: {k: v for k, v in r.items() if k != "vocab_size"}, "vocab_size"),
    "shape": (lambda r: dict(r, intermediate_size=64),
              r"mlp.gate_proj.weight has shape \[80, 48\], config.json implies \[64, 48\]"),
    "missing_tensors": (lambda r: dict(r, num_hidden_layers=3),
                        "9 missing tensor.*for a LlamaForCausalLM with 3 layers"),
    "unexpected_tensors": (lambda r: dict(r, num_hidden_layers=1), "9 unexpected tensor"),
    # a Llama's tensors read as a Qwen2's lack its q/k/v biases
    "qwen2_biases": (lambda r: dict(r, model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
                     r"6 missing tensor.*Qwen2ForCausalLM.*q_proj.bias"),
    "sliding_window": (lambda r: dict(r, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                                      use_sliding_window=True, sliding_window=4),
                       "use_sliding_window=true is not supported"),
    "layer_types": (lambda r: dict(r, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                                   layer_types=["full_attention", "sliding_attention"]),
                    r"layer_types \['sliding_attention'\] are not supported"),
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


def test_tied_checkpoint_kept_tied_or_untied_on_request(hf_dirs, tmp_path):
    """A tied checkpoint is one parameter; untied on request the head starts as a copy. A stored
    head of a tied checkpoint is ignored, as transformers ignores it."""
    tied = hf_dirs["llama3-tied"]
    cfg, params = load_hf(tied)
    assert cfg.tie_embeddings and "lm_head.weight" not in params
    assert read_model_config(tied).tie_embeddings
    untied_cfg, got = load_hf(tied, untie_embeddings=True)
    assert not untied_cfg.tie_embeddings and not read_model_config(tied, True).tie_embeddings
    np.testing.assert_array_equal(got["lm_head.weight"], params["embed_tokens.weight"])
    assert got["lm_head.weight"] is not got["embed_tokens.weight"]
    out = tmp_path / "with-head"
    out.mkdir()
    (out / CONFIG_FILE).write_text((tied / CONFIG_FILE).read_text())
    save_file({**{hf_name(n): v for n, v in params.items()}, "lm_head.weight": np.zeros((V, H))},
              str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    assert load_hf(out)[1].keys() == params.keys()


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


def test_cli_inspect_and_convert(hf_dirs, tmp_path, capsys):
    hf_dir = hf_dirs["llama"]
    assert main(["inspect", str(hf_dir)]) == 0
    text = capsys.readouterr().out
    assert "model.layers.1.mlp.down_proj.weight" in text and "[48, 80]" in text
    assert "F64" in text and f"kv_heads = {KV}" in text
    assert main(["inspect", str(hf_dirs["llama3-tied"])]) == 0
    text = capsys.readouterr().out
    assert ("llama3 RoPE scaling, factor 4, low/high frequency factors 1/4, pretraining context 8"
            in text and "tied: one parameter for embedding and LM head" in text)
    assert main(["inspect", str(hf_dirs["qwen2"])]) == 0
    assert "q, k and v projections with biases (Qwen2)" in capsys.readouterr().out
    # every unsupported aspect is named, not only the first
    bad = _copy_with_config(hf_dirs["llama"], tmp_path / "many", lambda r: dict(
        r, mlp_bias=True, rope_scaling={"rope_type": "longrope", "factor": 2.0}, attention_bias=True))
    assert main(["inspect", str(bad)]) == 1
    text = capsys.readouterr().out
    assert all(w in text for w in ("mlp_bias=True", "rope_type='longrope'", "attention_bias=true",
                                   "not supported: attention, mlp, rope"))
    missing = _copy_with_config(hf_dirs["llama"], tmp_path / "qwen", lambda r: dict(
        r, model_type="qwen2", architectures=["Qwen2ForCausalLM"]))
    assert main(["inspect", str(missing)]) == 1
    assert "tensors      NOT SUPPORTED" in capsys.readouterr().out
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
