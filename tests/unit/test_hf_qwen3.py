"""Qwen3 and Qwen3-MoE checkpoints against transformers in float64, in one process.

A random ``Qwen3ForCausalLM`` (per-head q/k norms, a head dim of 12 with hidden 48 and 6 heads,
not hidden / heads = 8) and a random ``Qwen3MoeForCausalLM`` (the same attention, block 0 dense
by ``mlp_only_layers``, 4 experts top 2, ``norm_topk_prob`` true and false, no shared expert)
are written by transformers' save_pretrained and read by mpipar (``qk_norm``, ``head_dim``).
mpipar's logits equal transformers'; both train with AdamW and clipping (the MoE with
DeepSeek-V3's balance loss computed from transformers' router logits) and the losses, gradient
norms and trained weights agree to 1e-10 relative; the exported weights load in transformers and
give its logits; greedy generation with the KV cache equals transformers' ``generate``. A model
with ``qk_norm`` built from the configuration alone exports to a Qwen3 transformers computes
the same logits of. What is refused names the field, the value and the rule.

transformers' float32 casts are removed as in ``transformers_reference.py`` (Qwen3's RMSNorm,
its q/k norms included, and its RoPE redone in float64) and, for the MoE, the router's softmax
(``transformers_moe.py``). Layouts: mpi/test_hf_qwen3.py."""
from __future__ import annotations

import json

import numpy as np
import pytest
from mpi4py import MPI

from tests.transformers_moe import (E, FFN as EXPERT_FFN, TOPK, assert_export_round_trip,
                                    assert_trains_as_transformers, float64_moe)
from tests.transformers_reference import (B, EPS, FFN, H, HEADS, KV, LAYERS, PATCHES, S,
                                          STEPS, THETA, TOL, V,
                                          assert_export_gives_mpipar_logits, hf_loss, hf_model,
                                          mpipar_logits, mpipar_rank, rel, save_random, torch,
                                          torch_training, training_differences,
                                          transformers_logits)
from tests.generation import build_generator, transformers_greedy
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

from mpipar.checkpoint.huggingface import (HFCheckpointError, hf_config, load_hf,
                                           model_config_from_hf, read_model_config, support)
from mpipar.config import ModelConfig
from mpipar.hf import main as hf_main
from mpipar.inference.sampling import Sampling
from mpipar.layout import resolve_model
from mpipar.model.params import init_params
from mpipar.training import step as trainer

HEAD_DIM, DENSE, MOE_LAYERS = 12, 40, 3


@pytest.fixture
def qwen3_float64(monkeypatch):
    """transformers' Qwen3 and Qwen3-MoE in float64 throughout (norms, RoPE, router)."""
    for owner, attr, replacement in PATCHES:
        monkeypatch.setattr(owner, attr, replacement)
    float64_moe(monkeypatch, modeling_qwen3_moe.Qwen3MoeRMSNorm,
                modeling_qwen3_moe.Qwen3MoeRotaryEmbedding, modeling_qwen3_moe.Qwen3MoeTopKRouter)


def _sizes() -> dict:
    return dict(vocab_size=V, hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV,
                head_dim=HEAD_DIM, rope_theta=THETA, rms_norm_eps=EPS, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    cfg = Qwen3Config(num_hidden_layers=LAYERS, intermediate_size=FFN, **_sizes())
    return save_random(cfg, tmp_path_factory.mktemp("qwen3") / "qwen3")


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "no_norm_topk"])
def qwen3_moe_dir(request, tmp_path_factory):
    cfg = Qwen3MoeConfig(num_hidden_layers=MOE_LAYERS, intermediate_size=DENSE,
                         moe_intermediate_size=EXPERT_FFN, num_experts=E,
                         num_experts_per_tok=TOPK, norm_topk_prob=request.param,
                         mlp_only_layers=[0], **_sizes())
    return save_random(cfg, tmp_path_factory.mktemp("qwen3_moe") / "qwen3_moe")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "rows.npy"
    np.save(path, np.random.default_rng(5).integers(0, V, size=(STEPS * B, S + 1)))
    return path


# ----------------------------------------------------------------------------------- config
def test_qwen3_reads_as_qk_norm_with_its_own_head_dim(qwen3_dir):
    cfg, params = load_hf(qwen3_dir)
    assert (cfg.qk_norm, cfg.head_dim, cfg.attention_bias, cfg.moe_experts) == \
        (True, HEAD_DIM, False, 0)
    assert params["layers.1.self_attn.q_norm.weight"].shape == (HEAD_DIM,)
    assert params["layers.0.self_attn.q_proj.weight"].shape == (HEADS * HEAD_DIM, H)
    state = hf_model(qwen3_dir).state_dict()
    np.testing.assert_array_equal(params["layers.0.self_attn.k_norm.weight"],
                                  state["model.layers.0.self_attn.k_norm.weight"].numpy())
    raw = json.loads((qwen3_dir / "config.json").read_text())
    reading = {s.aspect: s for s in support(raw)[0]}["attention"].reading
    assert "q_norm" in reading, reading


def test_the_command_line_inspects_and_refuses_with_exit_2(qwen3_dir, tmp_path, capsys):
    assert hf_main(["inspect", str(qwen3_dir)]) == 0
    assert "Qwen3's q_norm, k_norm" in capsys.readouterr().out
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((qwen3_dir / "model.safetensors").read_bytes())
    raw = json.loads((qwen3_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "attention_bias": True}))
    assert hf_main(["convert", str(bad), str(tmp_path / "out")]) == 2
    assert "attention_bias=True is not supported for model_type 'qwen3'" in \
        capsys.readouterr().err


@pytest.mark.parametrize("change,rule", [
    (dict(attention_bias=True), "attention_bias=True is not supported for model_type 'qwen3'"),
    (dict(use_sliding_window=True), "use_sliding_window=True is not supported"),
    (dict(layer_types=["full_attention", "sliding_attention"]),
     "layer_types ['sliding_attention'] are not supported"),
    (dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
          shared_expert_intermediate_size=32),
     "shared_expert_intermediate_size=32 is not supported for model_type 'qwen3_moe'"),
    (dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], mlp_only_layers=[0, 1]),
     "no sparse layer"),
    (dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=8,
          num_local_experts=4), "num_local_experts=4 contradicts num_experts=8"),
    (dict(architectures=["Qwen2ForCausalLM"]), "architectures=['Qwen2ForCausalLM'] is not "
                                               "supported for model_type 'qwen3'"),
])
def test_what_mpipar_cannot_compute_is_refused_naming_the_field(qwen3_dir, change, rule):
    raw = {**json.loads((qwen3_dir / "config.json").read_text()), **change}
    problems = [s.problem for s in support(raw)[0] if s.problem]
    assert any(rule in p for p in problems), problems
    with pytest.raises(HFCheckpointError, match="config.json: "):
        model_config_from_hf(raw)


def test_qwen3_moe_reads_its_sparse_layers(qwen3_moe_dir):
    cfg = read_model_config(qwen3_moe_dir)
    assert (cfg.qk_norm, cfg.head_dim, cfg.moe_experts, cfg.moe_top_k, cfg.moe_ffn_hidden,
            cfg.ffn_hidden, cfg.moe_shared_ffn_hidden) == (True, HEAD_DIM, E, TOPK, EXPERT_FFN,
                                                           DENSE, 0)
    assert [cfg.is_sparse(i) for i in range(MOE_LAYERS)] == [False, True, True]
    raw = json.loads((qwen3_moe_dir / "config.json").read_text())
    assert cfg.moe_norm_topk is raw["norm_topk_prob"]
    step2 = model_config_from_hf({**raw, "mlp_only_layers": [], "decoder_sparse_step": 2})
    assert [step2.is_sparse(i) for i in range(MOE_LAYERS)] == [False, True, False]
    reading = {s.aspect: s for s in support(raw)[0]}["experts"].reading
    assert reading.startswith("Qwen3-MoE experts: 4") and "no shared expert" in reading
    hub = {k: v for k, v in raw.items() if k != "num_local_experts"}   # the released name
    assert model_config_from_hf({**hub, "num_experts": E}).moe_experts == E


# ------------------------------------------------------------------- logits and training
def test_qwen3_logits_and_training_equal_transformers(qwen3_dir, rows, qwen3_float64, tmp_path):
    cfg, params = load_hf(qwen3_dir)
    tokens = np.load(rows)[:B, :S]
    rank = mpipar_rank(cfg, params, rows)
    err = rel(mpipar_logits(rank, tokens), transformers_logits(qwen3_dir, tokens))
    results = [trainer.train_step(rank, k) for k in range(STEPS)]
    trained = trainer.gather_params(rank)
    loss_diffs, param_diff = training_differences(results, trained,
                                                  torch_training(qwen3_dir, rows))
    moved = max(rel(trained[n], params[n]) for n in trained)
    print(f"\nqwen3: logits rel diff {err:.2e}; after {STEPS} steps max param rel diff "
          f"{param_diff:.2e} (moved {moved:.2e}), loss diffs {loss_diffs}")
    assert err <= TOL and max(loss_diffs) <= TOL and param_diff <= TOL and moved > 1e-3
    assert rel(trained["layers.0.self_attn.q_norm.weight"],
               params["layers.0.self_attn.q_norm.weight"]) > 1e-3    # the norms train

    # --export-hf: transformers loads the trained weights and computes mpipar's logits.
    assert_export_gives_mpipar_logits(cfg, trained, rows, tmp_path / "trained",
                                      "Qwen3ForCausalLM")
    trainer.close(rank)


def test_qwen3_moe_trains_as_transformers(qwen3_moe_dir, tmp_path, qwen3_float64):
    want = assert_trains_as_transformers(qwen3_moe_dir, tmp_path, sparse_layers=MOE_LAYERS - 1)
    assert "layers.1.self_attn.k_norm.weight" in want and "layers.0.mlp.up_proj.weight" in want


def test_qwen3_moe_export_loads_in_transformers(qwen3_moe_dir, tmp_path, qwen3_float64):
    assert_export_round_trip(qwen3_moe_dir, tmp_path / "out")
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3MoeForCausalLM"] and raw["mlp_only_layers"] == [0]
    assert raw["norm_topk_prob"] is read_model_config(qwen3_moe_dir).moe_norm_topk
    assert "shared_expert_intermediate_size" not in raw and raw["head_dim"] == HEAD_DIM
    tokens = np.random.default_rng(0).integers(0, V, (B, S))
    cfg, params = load_hf(tmp_path / "out")
    rows = tmp_path / "rows.npy"
    np.save(rows, np.random.default_rng(5).integers(0, V, size=(STEPS * B, S + 1)))
    got = mpipar_logits(mpipar_rank(cfg, params, rows), tokens)
    assert rel(got, transformers_logits(tmp_path / "out", tokens)) <= TOL


# ------------------------------------------------------------------------- from scratch
def test_a_qk_norm_model_from_the_configuration_exports_as_qwen3(tmp_path, rows, qwen3_float64):
    """qk_norm and head_dim set in mpipar's own configuration: trained from its own
    initialisation, exported, and transformers computes the same logits; with q/k/v biases it
    has no Qwen3 form and the export names the fields."""
    cfg = resolve_model(ModelConfig(vocab_size=V, hidden=H, layers=2, heads=HEADS, kv_heads=KV,
                                    head_dim=HEAD_DIM, ffn_hidden=FFN, qk_norm=True,
                                    norm_eps=EPS, rope_theta=THETA))
    rank = mpipar_rank(cfg, init_params(cfg, 7, np.float64), rows)
    trainer.train_step(rank, 0)
    trained = trainer.gather_params(rank)
    trainer.close(rank)
    assert_export_gives_mpipar_logits(cfg, trained, rows, tmp_path / "scratch",
                                      "Qwen3ForCausalLM")
    biased = ModelConfig(**{**cfg.__dict__, "attention_bias": True})
    with pytest.raises(HFCheckpointError, match="model.qk_norm=True with attention_bias=True"):
        hf_config(biased, "float64")


# --------------------------------------------------------------------------- generation
def test_qwen3_greedy_generation_equals_transformers(qwen3_dir, qwen3_float64):
    _greedy_equals_transformers(qwen3_dir, "qwen3")


def test_qwen3_moe_greedy_generation_equals_transformers(qwen3_moe_dir, qwen3_float64):
    _greedy_equals_transformers(qwen3_moe_dir, "qwen3_moe")


def _greedy_equals_transformers(path, kind: str) -> None:
    import transformers
    cfg, params = load_hf(path)
    generator = build_generator(cfg, MPI.COMM_SELF)
    generator.load_params(params)
    prompt, new = [5, 17, 42, 3, 88], 10
    got = generator.generate(prompt, new, Sampling(0.0), keep_logits=True)
    want, logits = transformers_greedy(transformers, path, prompt, new)
    err = max(rel(a, b) for a, b in zip(got.logits, logits))
    print(f"\n{kind} greedy ids {got.ids}; KV-cache logits vs transformers: {err:.2e}")
    assert got.ids == want and err <= TOL


def test_the_command_line_trains_qk_norm_and_both_exports_load(tmp_path, qwen3_float64):
    """``python -m mpipar.train --qk-norm --head-dim 12 --export-hf`` and ``python -m
    mpipar.ckpt export-hf`` of its checkpoint write the same Qwen3ForCausalLM, which
    transformers loads."""
    from mpipar.checkpoint import cli
    from tests.unit.test_moe_bias import _train
    from tests.untrusted import TINY
    code, _, err = _train([*TINY, "--qk-norm", "--head-dim", "12", "--steps", "2",
                           "--save-dir", str(tmp_path / "ckpt"), "--run-dir",
                           str(tmp_path / "run"), "--export-hf", str(tmp_path / "hf")])
    assert code == 0, err[-2000:]
    assert cli.main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "again")]) == 0
    cfg, params = load_hf(tmp_path / "hf")
    assert (cfg.qk_norm, cfg.head_dim) == (True, 12)
    assert load_hf(tmp_path / "again")[1].keys() == params.keys()
    for name, value in load_hf(tmp_path / "again")[1].items():
        np.testing.assert_array_equal(value, params[name])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    np.testing.assert_array_equal(model.state_dict()["model.layers.1.self_attn.q_norm.weight"]
                                  .numpy(), params["layers.1.self_attn.q_norm.weight"])
