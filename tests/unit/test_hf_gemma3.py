"""Gemma 3 (text) checkpoints against transformers in float64, in one process.

A random ``Gemma3ForCausalLM`` (hidden 64, 4 layers: sliding-window layers 0, 1, 3 with a window
of 5 < S = 12 and RoPE base 10000, global layer 2 with base 1e6 and linear scaling; q/k norms,
four norms per block scaled by 1 + w, the embedding scaled by sqrt(hidden), GeGLU with tanh
GELU, ``query_pre_attn_scalar`` 24 (not head_dim 16), tied embeddings) is written by
transformers' save_pretrained and read by mpipar. mpipar's logits equal transformers'; both
train three AdamW steps with clipping and the losses, gradient norms and trained weights agree
to 1e-10 relative (``pad_token_id`` null: transformers' embedding gives the padding row no
gradient from its lookups, which mpipar does not model); the export loads in transformers and gives its logits; greedy generation with
the KV cache equals transformers' ``generate``. What is refused names the field and the rule.

transformers' float32 casts are removed as in ``transformers_reference.py``: Gemma 3's RMSNorm
(``(1 + w)`` of the normalised input, in the input's dtype) and its per-layer-type RoPE, both
redone in float64. Layouts: mpi/test_hf_gemma3.py."""
from __future__ import annotations

import json

import numpy as np
import pytest
from mpi4py import MPI

from tests.generation import build_generator, transformers_greedy
from tests.transformers_reference import (B, S, STEPS, TOL, assert_export_gives_mpipar_logits,
                                          mpipar_logits, mpipar_rank, rel, save_random, torch,
                                          torch_float_is_float64, torch_training,
                                          training_differences, transformers_logits)
from transformers import Gemma3TextConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.gemma3 import modeling_gemma3  # noqa: E402

from mpipar.checkpoint.huggingface import (HFCheckpointError, hf_config, load_hf,
                                           model_config_from_hf, support)
from mpipar.config import ModelConfig
from mpipar.hf import main as hf_main
from mpipar.inference.sampling import Sampling
from mpipar.layout import resolve_model
from mpipar.model.params import init_params
from mpipar.training import step as trainer

V, H, LAYERS, HEADS, KV, HEAD_DIM, FFN, WINDOW, SCALAR = 64, 64, 4, 4, 2, 16, 96, 5, 24
TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}


def rmsnorm_own_dtype(self, x):
    """Gemma3RMSNorm.forward without its float32 cast: ``(1 + w)`` times the normalised x."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def rotary_float64(self, x, position_ids, layer_type):
    """Gemma3RotaryEmbedding.forward with its layer type's init function run in float64."""
    kind = self.rope_type[layer_type]
    init = (self.compute_default_rope_parameters if kind == "default"
            else ROPE_INIT_FUNCTIONS[kind])
    with torch.no_grad(), torch_float_is_float64():
        inv_freq, scaling = init(self.config, x.device, layer_type=layer_type)
        freqs = position_ids[..., None].to(torch.float64) * inv_freq.to(torch.float64)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)


@pytest.fixture(scope="module")
def float64_gemma3():
    patch = pytest.MonkeyPatch()
    patch.setattr(modeling_gemma3.Gemma3RMSNorm, "forward", rmsnorm_own_dtype)
    patch.setattr(modeling_gemma3.Gemma3RotaryEmbedding, "forward", rotary_float64)
    yield
    patch.undo()


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, float64_gemma3):
    cfg = Gemma3TextConfig(vocab_size=V, hidden_size=H, intermediate_size=FFN,
                           num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                           num_key_value_heads=KV, head_dim=HEAD_DIM, sliding_window=WINDOW,
                           layer_types=TYPES, rope_parameters=ROPE,
                           query_pre_attn_scalar=SCALAR, max_position_embeddings=64,
                           tie_word_embeddings=True, rms_norm_eps=1e-6, pad_token_id=None)
    return save_random(cfg, tmp_path_factory.mktemp("gemma3") / "gemma3")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "rows.npy"
    np.save(path, np.random.default_rng(5).integers(0, V, size=(STEPS * B, S + 1)))
    return path


# ----------------------------------------------------------------------------------- config
def test_gemma3_reads_as_its_fields_and_refuses_what_mpipar_does_not_compute(gemma_dir, tmp_path,
                                                                             capsys):
    cfg, params = load_hf(gemma_dir)
    assert (cfg.norm_placement, cfg.norm_unit_offset, cfg.embed_scale, cfg.ffn_activation,
            cfg.qk_norm, cfg.tie_embeddings) == ("sandwich", True, True, "gelu_tanh", True, True)
    assert (cfg.query_pre_attn_scalar, cfg.rope_local_theta, cfg.rope_theta, cfg.rope_type,
            cfg.rope_factor) == (SCALAR, 10000.0, 1e6, "linear", 2.0)
    assert cfg.windows() == [WINDOW, WINDOW, 0, WINDOW]
    assert [cfg.local_rope(i) for i in range(LAYERS)] == [True, True, False, True]
    assert params["layers.3.pre_feedforward_layernorm.weight"].shape == (H,)
    assert hf_main(["inspect", str(gemma_dir)]) == 0
    assert "Gemma 3: 3 sliding-window layers of 5 positions" in capsys.readouterr().out
    raw = json.loads((gemma_dir / "config.json").read_text())
    for change, rule in [
            (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0 is not supported"),
            (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0 is not supported"),
            (dict(hidden_activation="silu"), "hidden_activation='silu' is not supported"),
            (dict(layer_types=TYPES[:3] + ["chunked_attention"]),
             "layer_types ['chunked_attention'] are not supported"),
            (dict(rope_parameters={**ROPE, "sliding_attention": ROPE["full_attention"]}),
             "rope_parameters.sliding_attention.rope_type='linear' is not supported")]:
        problems = [s.problem for s in support({**raw, **change})[0] if s.problem]
        assert any(rule in p for p in problems), problems
        with pytest.raises(HFCheckpointError, match="config.json: "):
            model_config_from_hf({**raw, **change})
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((gemma_dir / "model.safetensors").read_bytes())
    (bad / "config.json").write_text(json.dumps({**raw, "final_logit_softcapping": 30.0}))
    assert hf_main(["convert", str(bad), str(tmp_path / "out")]) == 2
    assert "final_logit_softcapping=30.0 is not supported" in capsys.readouterr().err
    old = {k: v for k, v in raw.items() if k not in ("layer_types", "rope_parameters")}
    old.update(sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=1000.0)
    legacy = model_config_from_hf(old)            # transformers 4.x's spelling
    assert (legacy.windows(), legacy.rope_local_theta, legacy.rope_type) == \
        ([WINDOW, 0, WINDOW, 0], 1000.0, "default")


# ------------------------------------------------------------------- logits and training
def test_gemma3_logits_training_and_export_equal_transformers(gemma_dir, rows, tmp_path):
    cfg, params = load_hf(gemma_dir)
    tokens = np.load(rows)[:B, :S]
    rank = mpipar_rank(cfg, params, rows)
    err = rel(mpipar_logits(rank, tokens), transformers_logits(gemma_dir, tokens))
    results = [trainer.train_step(rank, k) for k in range(STEPS)]
    trained = trainer.gather_params(rank)
    trainer.close(rank)
    loss_diffs, param_diff = training_differences(results, trained,
                                                  torch_training(gemma_dir, rows))
    moved = min(rel(trained[n], params[n]) for n in trained)
    print(f"\ngemma3: logits rel diff {err:.2e}; after {STEPS} steps max param rel diff "
          f"{param_diff:.2e} (least moved {moved:.2e}), loss diffs {loss_diffs}")
    assert err <= TOL and max(loss_diffs) <= TOL and param_diff <= TOL and moved > 1e-4

    raw = assert_export_gives_mpipar_logits(cfg, trained, rows, tmp_path / "trained",
                                            "Gemma3ForCausalLM")
    assert (raw["layer_types"], raw["query_pre_attn_scalar"]) == (TYPES, SCALAR)


def test_a_gemma_model_from_the_configuration_exports_as_gemma3(tmp_path, rows, float64_gemma3):
    """Gemma's settings in mpipar's own configuration (its norms starting at 0): trained one
    step, exported, and transformers computes the same logits; with one setting missing it has
    no Gemma 3 form and the export names the field."""
    cfg = resolve_model(ModelConfig(
        vocab_size=V, hidden=H, layers=2, heads=HEADS, kv_heads=KV, head_dim=HEAD_DIM,
        ffn_hidden=FFN, qk_norm=True, norm_placement="sandwich", norm_unit_offset=True,
        embed_scale=True, ffn_activation="gelu_tanh", query_pre_attn_scalar=SCALAR,
        sliding_window=WINDOW, window_layers="0", rope_local_theta=100.0, rope_theta=1e4,
        tie_embeddings=True, norm_eps=1e-6))
    start = init_params(cfg, 7, np.float64)
    assert not start["layers.1.post_feedforward_layernorm.weight"].any()
    rank = mpipar_rank(cfg, start, rows)
    trainer.train_step(rank, 0)
    trained = trainer.gather_params(rank)
    trainer.close(rank)
    assert_export_gives_mpipar_logits(cfg, trained, rows, tmp_path / "scratch",
                                      "Gemma3ForCausalLM")
    plain = ModelConfig(**{**cfg.__dict__, "embed_scale": False})
    with pytest.raises(HFCheckpointError, match="model.embed_scale=False: a model with Gemma"):
        hf_config(plain, "float64")


# --------------------------------------------------------------------------- generation
def test_gemma3_greedy_generation_equals_transformers(gemma_dir):
    import transformers
    cfg, params = load_hf(gemma_dir)
    generator = build_generator(cfg, MPI.COMM_SELF)
    generator.load_params(params)
    prompt, new = [5, 17, 42, 3, 8, 9, 11], 8       # past the window of 5
    got = generator.generate(prompt, new, Sampling(0.0), keep_logits=True)
    want, logits = transformers_greedy(transformers, gemma_dir, prompt, new)
    err = max(rel(a, b) for a, b in zip(got.logits, logits))
    print(f"\ngemma3 greedy ids {got.ids}; KV-cache logits vs transformers: {err:.2e}")
    assert got.ids == want and err <= TOL
