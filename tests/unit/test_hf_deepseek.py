"""DeepSeek-V3 checkpoints against transformers in float64, in one process.

A random ``DeepseekV3ForCausalLM`` (:mod:`tests.deepseek_reference`: multi-head latent
attention with a query latent and values narrower than queries, layer 0 dense, grouped sigmoid
routing with selection biases and a routed scale, two shared experts) is written by
transformers' save_pretrained and read by mpipar. mpipar's logits equal transformers'; both
train two AdamW steps with clipping and the grouped router's balance loss, and the losses,
balance losses, gradient norms and trained weights agree to 1e-10 relative; the export loads in
transformers and gives mpipar's logits; greedy generation with the latent KV cache (its
up-projection absorbed, and rebuilt) and with the expanded one equals transformers'
``generate``, each cache holding the bytes a token the
memory model counts. So do the logits and training of a model with the released checkpoints'
yarn RoPE. A model without a query latent (``q_lora_rank`` null) and one built
from mpipar's configuration alone give transformers' logits too. What is refused names the
field. Layouts: mpi/test_hf_deepseek.py."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from mpi4py import MPI

from tests.deepseek_reference import (ALPHA, B, E, GROUPS, HEADS, LAYERS, S, SCALE, STEPS,
                                      TOPK, TOPK_GROUPS, V, YARN, float64_deepseek, loaded,
                                      random_model, torch_training)
from tests.generation import build_generator
from tests.transformers_reference import TOL, mpipar_logits, mpipar_rank, rel, torch

from mpipar.checkpoint.huggingface import (HFCheckpointError, hf_config, load_hf,
                                           load_selection_biases,
                                           model_config_from_hf, read_model_config, save_hf,
                                           support)
from mpipar.config import ModelConfig
from mpipar.hf import main as hf_main
from mpipar.inference.sampling import Sampling
from mpipar.layout import resolve_model
from mpipar.model.latent_attention import LatentKVCache
from mpipar.model.params import init_params
from mpipar.plan.memory import kv_cache_width
from mpipar.training import step as trainer


@pytest.fixture
def deepseek_float64(monkeypatch):
    float64_deepseek(monkeypatch)


@pytest.fixture(scope="module")
def model():
    return random_model()


@pytest.fixture(scope="module")
def hf_dir(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek") / "deepseek"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "rows.npy"
    np.save(path, np.random.default_rng(5).integers(0, V, size=(STEPS * B, S + 1)))
    return path


def deepseek_rank(path, rows, params=None, **fields):
    cfg, read = load_hf(path)
    for name, value in fields.items():
        setattr(cfg, name, value)
    rank = mpipar_rank(cfg, read if params is None else params, rows)
    rank.model.routing.load(load_selection_biases(path))
    return rank


def transformers_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens)).logits.numpy()


# ----------------------------------------------------------------------------------- config
def test_deepseek_reads_as_latent_attention_with_the_grouped_router(hf_dir, capsys):
    cfg = read_model_config(hf_dir)
    assert (cfg.latent_kv_rank, cfg.latent_q_rank, cfg.rope_head_dim, cfg.head_dim,
            cfg.v_head_dim, cfg.kv_heads) == (12, 16, 4, 12, 6, 4)
    assert (cfg.moe_router, cfg.moe_experts, cfg.moe_top_k, cfg.moe_groups, cfg.moe_topk_groups,
            cfg.moe_routed_scale, cfg.moe_shared_ffn_hidden, cfg.moe_shared_gate) == \
        ("grouped_sigmoid", E, TOPK, GROUPS, TOPK_GROUPS, SCALE, 32, False)
    assert [cfg.is_sparse(i) for i in range(LAYERS)] == [False, True, True]
    biases = load_selection_biases(hf_dir)
    assert sorted(biases) == [1, 2] and biases[1].shape == (E,) and abs(biases[1]).max() > 0
    assert hf_main(["inspect", str(hf_dir)]) == 0
    out = capsys.readouterr().out
    assert "multi-head latent attention" in out and "no module stored" in out


def test_multi_token_prediction_tensors_are_not_read_without_the_module(hf_dir, tmp_path):
    """A checkpoint declaring an MTP module (layer num_hidden_layers) that stores no projection
    for it reads with model.mtp_depth 0 and leaves the layer's tensors (here a copy of the
    embedding) unread (modules read and written: unit/test_mtp.py)."""
    from safetensors.numpy import load_file, save_file
    tensors = load_file(hf_dir / "model.safetensors")
    tensors[f"model.layers.{LAYERS}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    (tmp_path / "mtp").mkdir()
    save_file(tensors, str(tmp_path / "mtp" / "model.safetensors"))
    (tmp_path / "mtp" / "config.json").write_text((hf_dir / "config.json").read_text())
    cfg, read = load_hf(tmp_path / "mtp")
    assert cfg.mtp_depth == 0 and sorted(read) == sorted(load_hf(hf_dir)[1])


@pytest.mark.parametrize("change,rule", [
    (dict(rope_parameters={"rope_type": "yarn", "factor": 40.0, "rope_theta": 1e4}),
     "rope_parameters.original_max_position_embeddings is missing"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 must equal num_attention_heads=4"),
    (dict(attention_bias=True), "attention_bias=True is not supported for model_type"),
    (dict(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
    (dict(first_k_dense_replace=3), "first_k_dense_replace=3 must be below"),
    (dict(v_head_dim=20), "v_head_dim=20 must be <= qk_nope_head_dim + qk_rope_head_dim"),
    (dict(n_group=3), "n_group=3, topk_group=2: n_group must divide n_routed_experts=8"),
])
def test_what_mpipar_cannot_compute_is_refused_naming_the_field(hf_dir, change, rule):
    raw = {**json.loads((hf_dir / "config.json").read_text()), **change}
    problems = [s.problem for s in support(raw)[0] if s.problem]
    with pytest.raises(Exception) as info:
        model_config_from_hf(raw)
    assert any(rule in p for p in problems) or rule in str(info.value), (problems, info.value)


# ------------------------------------------------------------------- logits and training
def assert_trains_as_transformers(model, hf_dir, rows, name: str):
    """mpipar's logits of the checkpoint at ``hf_dir`` (transformers' ``model``) and STEPS AdamW
    steps with the balance loss equal transformers' to TOL: (trained parameters, biases)."""
    tokens = np.load(rows)[:B, :S]
    model.eval()
    rank = deepseek_rank(hf_dir, rows, moe_aux_loss_coef=ALPHA)
    _, params = load_hf(hf_dir)
    err = rel(mpipar_logits(rank, tokens), transformers_logits(model, tokens))
    results = [trainer.train_step(rank, k) for k in range(STEPS)]
    trained = trainer.gather_params(rank)
    biases = rank.model.routing.host()
    trainer.close(rank)
    ce, aux, norms, want = torch_training(model, np.load(rows))
    assert sorted(trained) == sorted(want)
    for r, c, a, n in zip(results, ce, aux, norms):
        assert abs(r.loss - c) <= TOL * c and abs(r.grad_norm - n) <= TOL * n, (r, c, n)
        assert abs(r.moe["moe_aux_loss"] - a) <= TOL * a, (r.moe["moe_aux_loss"], a)
    param_diff = max(rel(v, want[n]) for n, v in trained.items())
    moved = max(rel(trained[n], params[n]) for n in trained)
    print(f"\n{name}: logits rel diff {err:.2e}; after {STEPS} steps max param rel diff "
          f"{param_diff:.2e} (moved {moved:.2e})")
    assert err <= TOL and param_diff <= TOL and moved > 1e-3
    return trained, biases


def test_deepseek_logits_and_training_equal_transformers(model, hf_dir, rows, tmp_path,
                                                         deepseek_float64):
    trained, biases = assert_trains_as_transformers(model, hf_dir, rows, "deepseek_v3")
    tokens = np.load(rows)[:B, :S]

    # --export-hf: transformers loads the trained weights (nothing missing or unexpected)
    # and computes mpipar's logits.
    save_hf(tmp_path / "trained", load_hf(hf_dir)[0], trained, biases=biases)
    from transformers import AutoModelForCausalLM
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "trained", dtype=torch.float64,
                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    again = deepseek_rank(tmp_path / "trained", rows)
    assert rel(transformers_logits(loaded(tmp_path / "trained"), tokens),
               mpipar_logits(again, tokens)) <= TOL
    trainer.close(again)


def test_yarn_rope_logits_and_training_equal_transformers(tmp_path, rows, deepseek_float64):
    """The released checkpoints' yarn RoPE: its frequencies, the attention factor on the tables
    (mscale != mscale_all_dim) and the softmax-scale factor of mscale_all_dim; the export writes
    the yarn fields back."""
    yarn = random_model(rope_parameters=dict(YARN), max_position_embeddings=4 * 4096)
    yarn.save_pretrained(tmp_path / "yarn")
    cfg = read_model_config(tmp_path / "yarn")
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_positions, cfg.rope_mscale,
            cfg.rope_mscale_all_dim) == ("yarn", 4.0, 4096, 1.0, 0.8)
    assert_trains_as_transformers(yarn, tmp_path / "yarn", rows, "deepseek_v3 yarn")
    written = hf_config(cfg, "float64")["rope_parameters"]
    assert written == {k: v for k, v in YARN.items() if k not in ("beta_fast", "beta_slow")}


def test_without_a_query_latent_the_logits_equal_transformers(tmp_path, rows, deepseek_float64):
    plain = random_model(q_lora_rank=None)
    plain.save_pretrained(tmp_path / "plain")
    assert read_model_config(tmp_path / "plain").latent_q_rank == 0
    rank = deepseek_rank(tmp_path / "plain", rows)
    tokens = np.load(rows)[:B, :S]
    plain.eval()
    assert rel(mpipar_logits(rank, tokens), transformers_logits(plain, tokens)) <= TOL
    trainer.close(rank)


def test_a_latent_model_from_the_configuration_exports_as_deepseek(tmp_path, rows,
                                                                   deepseek_float64):
    """Latent attention and the grouped router set in mpipar's own configuration: its
    initialisation exported, transformers computes the same logits."""
    cfg = resolve_model(ModelConfig(
        vocab_size=V, hidden=32, layers=2, heads=4, kv_heads=4, head_dim=10, ffn_hidden=40,
        latent_kv_rank=8, latent_q_rank=12, rope_head_dim=4, v_head_dim=8, norm_eps=1e-6,
        moe_experts=4, moe_top_k=2, moe_ffn_hidden=16, moe_layers="1",
        moe_router="grouped_sigmoid", moe_groups=2, moe_topk_groups=1, moe_routed_scale=1.5,
        moe_shared_ffn_hidden=16))
    params = init_params(cfg, 7, np.float64)
    save_hf(tmp_path / "scratch", cfg, params)
    rank = deepseek_rank(tmp_path / "scratch", rows)
    tokens = np.load(rows)[:B, :S]
    want = transformers_logits(loaded(tmp_path / "scratch"), tokens)
    assert rel(mpipar_logits(rank, tokens), want) <= TOL
    trainer.close(rank)
    softmax = ModelConfig(**{**cfg.__dict__, "moe_router": "softmax", "moe_groups": 1,
                             "moe_topk_groups": 1})
    with pytest.raises(HFCheckpointError, match="exported as DeepseekV3ForCausalLM"):
        hf_config(softmax, "float64")


# --------------------------------------------------------------------------- generation
def test_deepseek_greedy_generation_equals_transformers(model, hf_dir, deepseek_float64):
    """With the latent cache (the compressed latent and the RoPE key a position), attended with
    ``kv_b_proj`` absorbed (the default) and by expanding the latents, and with the expanded
    cache (every head's keys and values): transformers' tokens, the same logits; each cache's
    allocation is the analytic count of bytes a token (:func:`kv_cache_width`)."""
    cfg, params = load_hf(hf_dir)
    generator = build_generator(cfg, MPI.COMM_SELF)
    generator.load_params(params, load_selection_biases(hf_dir))
    prompt, new = [5, 17, 42, 3, 50], 8
    caches = {latent: generator.new_cache(len(prompt) + new, latent) for latent in (True, False)}
    got = {latent: generator.generate(prompt, new, Sampling(0.0), keep_logits=True, cache=kv)
           for latent, kv in caches.items()}
    rebuilt = generator.generate(prompt, new, Sampling(0.0), keep_logits=True,
                                 cache=generator.new_cache(len(prompt) + new, True, absorb=False))
    absorbed = max(rel(a, b) for a, b in zip(got[True].logits, rebuilt.logits))
    print(f"\nabsorbed vs expanded latents: logits {absorbed:.2e}")
    assert rebuilt.ids == got[True].ids and absorbed <= TOL
    assert caches[True].absorb is not None
    model.eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
        logits = model(out).logits[0, len(prompt) - 1:-1].numpy()
    err = max(rel(a, b) for g in got.values() for a, b in zip(g.logits, logits))
    same = max(rel(a, b) for a, b in zip(got[True].logits, got[False].logits))
    per_token = {latent: kv.nbytes // (len(prompt) + new) for latent, kv in caches.items()}
    print(f"\ndeepseek_v3 greedy ids {got[True].ids}; KV-cache logits vs transformers: "
          f"{err:.2e}, latent vs expanded cache {same:.2e}; bytes a token {per_token}")
    assert got[True].ids == got[False].ids == out[0, len(prompt):].tolist()
    assert err <= TOL and same <= TOL
    assert type(caches[True]) is LatentKVCache
    assert per_token == {True: 8 * LAYERS * (12 + 4), False: 8 * LAYERS * 2 * HEADS * 12}
    assert per_token == {latent: 8 * LAYERS * kv_cache_width(cfg if latent else replace(
        cfg, latent_kv_rank=0, latent_q_rank=0, rope_head_dim=0, v_head_dim=0), 1)
        for latent in (True, False)}
