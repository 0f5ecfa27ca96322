"""Multi-token prediction (``--mtp-depth D --mtp-loss-coef lambda``, DeepSeek-V3 report section
2.2) on one process against a NumPy implementation of the report's equations written here:
each module k on the sequence shortened to the S - k positions that have a target k + 1 ahead
(the engine runs the whole row and weighs the tail 0: causal attention makes the two equal).
The loss of the main head and L_MTP = lambda / D * sum_k mean CE_k to 1e-12; the gradient of
their sum along a random direction per parameter against the reference's complex-step
derivative (exact to rounding: no difference quotient) to 1e-10; the configuration's refusals.
"""
from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest

from mpipar.config import ConfigError, ModelConfig
from mpipar.kernels.numpy_ref import rope_inv_freq
from mpipar.model.mtp import mtp_weights
from mpipar.model.params import init_params
from mpipar.training.batches import _ahead
from tests.unit.test_model import CFG, make_stage

COEF = 0.3


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _block(p, n, x, c: ModelConfig):
    """One pre-norm Llama block on ``x`` ``[B, S, H]`` (complex-safe: complex-step)."""
    B, S, _ = x.shape
    D, hq, hkv = c.head_dim, c.heads, c.kv_heads
    inv = rope_inv_freq(D, c.rope_theta, c.rope_type, c.rope_factor, c.rope_low_freq_factor,
                        c.rope_high_freq_factor, c.rope_original_max_positions, S)
    ang = np.arange(S)[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[None, :, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[None, :, None, :]

    def rope(a):
        return a * cos + np.concatenate([-a[..., D // 2:], a[..., :D // 2]], -1) * sin

    h = _rms(x, p[n + "input_layernorm.weight"], c.norm_eps)
    q, k, v = (h @ p[n + f"self_attn.{w}_proj.weight"].T for w in "qkv")
    q, k = rope(q.reshape(B, S, hq, D)), rope(k.reshape(B, S, hkv, D))
    k = np.repeat(k, hq // hkv, axis=2)
    v = np.repeat(v.reshape(B, S, hkv, D), hq // hkv, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    s = np.where(np.tril(np.ones((S, S), bool)), s, -1e30)
    a = np.exp(s - s.real.max(-1, keepdims=True))
    a = a / a.sum(-1, keepdims=True)
    x = x + np.einsum("bhqk,bkhd->bqhd", a, v).reshape(B, S, hq * D) @ p[
        n + "self_attn.o_proj.weight"].T
    h = _rms(x, p[n + "post_attention_layernorm.weight"], c.norm_eps)
    g, u = h @ p[n + "mlp.gate_proj.weight"].T, h @ p[n + "mlp.up_proj.weight"].T
    return x + (g / (1 + np.exp(-g)) * u) @ p[n + "mlp.down_proj.weight"].T


def _ce(logits, targets):
    """Mean cross-entropy of ``logits`` ``[B, S, V]`` against ``targets`` ``[B, S]``."""
    m = logits.real.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    return (lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]).mean()


def reference(p, tokens, targets, c: ModelConfig, coef: float):
    """(main loss, L_MTP): the report's equations. ``tokens[:, i]`` is t_i, ``targets[:, i]``
    t_{i+1}; module k at positions i = 0 .. S-1-k: h'_i = M_k [RMSNorm(Emb(t_{i+k}));
    RMSNorm(h^{k-1}_i)], h^k = TRM_k(h'), P = softmax(Head(RMSNorm(h^k))) against t_{i+k+1}."""
    S, eps, head = tokens.shape[1], c.norm_eps, p.get("lm_head.weight", p["embed_tokens.weight"])
    h = p["embed_tokens.weight"][tokens]
    for i in range(c.layers):
        h = _block(p, f"layers.{i}.", h, c)
    main = _ce(_rms(h, p["norm.weight"], eps) @ head.T, targets)
    losses = []
    for k in range(1, c.mtp_depth + 1):
        n = f"layers.{c.layers + k - 1}."
        emb = p["embed_tokens.weight"][targets[:, k - 1:S - 1]]           # t_{i+k}
        cat = np.concatenate([_rms(emb, p[n + "enorm.weight"], eps),
                              _rms(h[:, :S - k], p[n + "hnorm.weight"], eps)], -1)
        h = _block(p, n, cat @ p[n + "eh_proj.weight"].T, c)
        losses.append(_ce(_rms(h, p[n + "shared_head.norm.weight"], eps) @ head.T,
                          targets[:, k:]))                                  # t_{i+k+1}
    return main, coef / c.mtp_depth * sum(losses)


def _random(p, seed):
    """``p`` with every norm weight and bias moved off its initial constant."""
    rng = np.random.default_rng(seed)
    return {n: v + rng.normal(0, 0.2, v.shape) if v.ndim == 1 else v for n, v in p.items()}


def engine(cfg, p, tokens, targets):
    """(main loss, L_MTP, gradients of their sum) of one forward and backward of the stage."""
    B, S = tokens.shape
    stage = make_stage(cfg=cfg)
    stage.mtp.weights = mtp_weights(cfg, B, S)
    ahead = _ahead(targets, np.arange(S), cfg.mtp_depth, np)
    loss, cache = stage.forward(p, tokens, np.arange(S), targets, ahead=ahead)
    grads = {n: np.zeros_like(v) for n, v in p.items()}
    stage.backward(p, grads, np.full(tokens.shape, 1.0 / tokens.size), cache)
    return float(loss.mean()), stage.mtp.loss, grads


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_equals_the_reports_equations(depth):
    cfg = dataclasses.replace(CFG, mtp_depth=depth, mtp_loss_coef=COEF)
    p = _random(init_params(cfg, 5, np.float64), 2)
    rng = np.random.default_rng(depth)
    tokens, targets = (rng.integers(0, cfg.vocab_size, (2, 7)) for _ in range(2))
    main, mtp, grads = engine(cfg, p, tokens, targets)
    want_main, want_mtp = reference(p, tokens, targets, cfg, COEF)
    assert abs(main - want_main) <= 1e-12 * abs(want_main)
    assert abs(mtp - want_mtp) <= 1e-12 * abs(want_mtp) and want_mtp > 0.1
    step = 1e-30   # complex step: Im f(p + i h v) / h = <grad f, v> to rounding
    for name in p:
        v = np.random.default_rng(zlib.crc32(name.encode())).normal(size=p[name].shape)
        q = dict(p, **{name: p[name] + 1j * step * v})
        want = sum(reference(q, tokens, targets, cfg, COEF)).imag / step
        got = float((grads[name] * v).sum())
        assert abs(got - want) <= 1e-10 * max(abs(want), 1e-3), (name, got, want)


def test_mtp_fields_refused_with_exit_2_naming_the_field():
    from mpipar.rules import validate
    from tests.layouts import small_config
    for model, fields, field in (
            ("llama", dict(mtp_depth=-1), "model.mtp_depth=-1"),
            ("llama", dict(mtp_depth=1, mtp_loss_coef=-0.5), "model.mtp_loss_coef=-0.5"),
            ("llama", dict(mtp_depth=15), "model.mtp_depth=15: must be < train.seq_len - 1")):
        cfg = small_config(model=model)
        cfg.model = dataclasses.replace(cfg.model, **fields)
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            validate(cfg, 1)
    cfg = small_config(model="mtp", pp=2, dp=2, grad_compression="int8")
    with pytest.raises(ConfigError, match=r"error feedback: not with model\.mtp_depth=2 and pp=2"):
        validate(cfg, 4)   # the embedding's copy on the last stage, as a tied one's


def test_a_step_reports_mtp_loss_and_counts_the_modules():
    """One process, the test model with two modules: the step's ``mtp_loss`` (the global
    batch's L_MTP, its weights from the configuration) equals the reference on the step's
    batch and initial weights, and reaches metrics.jsonl and the summary; the parameter count
    and the step's FLOPs include the modules."""
    import math
    from mpi4py import MPI
    from layouts import small_config, token_source
    from mpipar.model.flops import (block_flops_per_token, model_flops_per_step,
                                    mtp_module_flops_per_token)
    from mpipar.model.params import param_specs
    from mpipar.observe.metrics import GROUPS, TIME_KEYS, step_record
    from mpipar.observe.summary import summarize
    from mpipar.plan.memory import parameter_count
    from mpipar.rules import validate
    from mpipar.runtime.comm import Ledger
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    layout = validate(small_config(model="mtp"), 1)
    m, S = layout.model, layout.train.seq_len
    rank = build_rank(layout, MPI.COMM_SELF, source=token_source(S))
    p = trainer.gather_params(rank)
    tokens, targets = rank.data.sampler.batch(0)
    result = trainer.train_step(rank, 0)
    trainer.close(rank)
    main, mtp = reference(p, tokens, targets, m, m.mtp_loss_coef)
    assert abs(result.loss - main) <= 1e-12 * main
    assert abs(result.mtp_loss - mtp) <= 1e-12 * mtp
    row = {"memory": 0, "inter_bytes": 0, **dict.fromkeys(TIME_KEYS, 0.0),
           **{f"bytes_{g}": 0 for g in GROUPS}}
    record = step_record(result, [row], Ledger(), 1.0, 1.0, False, 0)
    assert record["mtp_loss"] == result.mtp_loss
    record.update(step_time_s=1.0, tokens_per_s=1.0, mfu=0.1)
    assert summarize([record])["mtp_loss_last"] == result.mtp_loss
    assert parameter_count(m) == sum(math.prod(s.shape) for s in param_specs(m))
    plain = dataclasses.replace(layout.config.model, mtp_depth=0)
    module = 4 * m.hidden ** 2 + block_flops_per_token(m, 1, (S + 1) / 2) + 2 * m.hidden * m.vocab_size
    assert mtp_module_flops_per_token(m, (S + 1) / 2) == module
    extra = model_flops_per_step(layout) - model_flops_per_step(
        dataclasses.replace(layout.config, model=plain))
    assert extra == 3.0 * 2 * module * layout.train.global_batch_size * S


def test_deepseek_export_and_import_carry_the_modules(tmp_path, capsys):
    """A DeepSeek-V3 with a module exports it as the released checkpoints store it (layer
    ``layers`` with enorm, hnorm, eh_proj, a decoder layer, shared_head.norm and copies of the
    embedding and head; ``num_nextn_predict_layers`` 1) and reads it back: the same parameters,
    the copies not read; without its tensors the same checkpoint reads with depth 0."""
    import json
    from safetensors.numpy import load_file, save_file
    from layouts import small_config
    from mpipar.checkpoint.huggingface import load_hf, load_selection_biases, save_hf
    from mpipar.hf import main as hf_main
    from mpipar.layout import resolve_model
    m = resolve_model(small_config(model="deepseek_mtp").model)
    p = init_params(m, 3, np.float64)
    biases = {i: np.arange(m.moe_experts) * 0.1 * i for i in (1, 2, 3, 4)}
    save_hf(tmp_path / "out", m, p, "float64", biases=biases)
    stored = load_file(tmp_path / "out" / "model.safetensors")
    L = m.layers
    assert json.loads((tmp_path / "out" / "config.json").read_text())[
        "num_nextn_predict_layers"] == 1
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.kv_a_proj_with_mqa.weight", "mlp.experts.7.down_proj.weight",
                 "mlp.shared_experts.up_proj.weight", "mlp.gate.e_score_correction_bias"):
        assert f"model.layers.{L}.{name}" in stored, name
    assert np.array_equal(stored[f"model.layers.{L}.embed_tokens.weight"],
                          p["embed_tokens.weight"])
    assert np.array_equal(stored[f"model.layers.{L}.shared_head.head.weight"], p["lm_head.weight"])
    cfg, read = load_hf(tmp_path / "out")
    assert cfg.mtp_depth == 1 and sorted(read) == sorted(p)
    assert all(np.array_equal(read[n], p[n]) for n in p)
    assert np.array_equal(load_selection_biases(tmp_path / "out")[L],
                          biases[L].astype(np.float32))   # float32, as transformers keeps it
    assert hf_main(["inspect", str(tmp_path / "out")]) == 0
    assert f"1 of 1 multi-token prediction module(s) stored as model.layers.{L}" in \
        capsys.readouterr().out
    (tmp_path / "bare").mkdir()
    save_file({n: v for n, v in stored.items() if not n.startswith(f"model.layers.{L}.")},
              str(tmp_path / "bare" / "model.safetensors"))
    (tmp_path / "bare" / "config.json").write_text((tmp_path / "out" / "config.json").read_text())
    cfg, read = load_hf(tmp_path / "bare")
    assert cfg.mtp_depth == 0 and sorted(read) == sorted(n for n in p if not
                                                         n.startswith(f"layers.{L}."))


def test_a_checkpoint_holds_the_modules_and_resumes_them(tmp_path):
    """The modules' weights and moments are saved with the rest: a run resumed from step 1's
    checkpoint trains step 2 to the same weights as the run that did not stop."""
    from mpi4py import MPI
    from layouts import small_config, token_source
    from mpipar.checkpoint import reader, writer
    from mpipar.rules import validate
    from mpipar.runtime.comm import Group, Ledger
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    layout = validate(small_config(model="mtp"), 1)

    def fresh():
        return build_rank(layout, MPI.COMM_SELF, source=token_source(layout.train.seq_len))

    whole = fresh()
    trainer.train_step(whole, 0)
    writer.save(whole.state, trainer.run_position(whole, 1), tmp_path,
                Group(whole.comms.grid.comm, "world", Ledger()))
    want = trainer.train_step(whole, 1).mtp_loss, trainer.gather_params(whole)
    resumed = fresh()
    assert reader.load(resumed.state, tmp_path / "step_00000001") == 1
    got = trainer.train_step(resumed, 1).mtp_loss, trainer.gather_params(resumed)
    assert got[0] == want[0] and any(n.startswith("layers.4.eh_proj") for n in want[1])
    assert all(np.array_equal(got[1][n], want[1][n]) for n in want[1])
    trainer.close(whole), trainer.close(resumed)


def test_recompute_modes_give_the_modules_bit_identical_gradients():
    """The modules' blocks keep what the recompute mode keeps and rebuild the rest in backward,
    bit for bit."""
    cfg = dataclasses.replace(CFG, mtp_depth=2, mtp_loss_coef=COEF)
    p = _random(init_params(cfg, 5, np.float64), 2)
    rng = np.random.default_rng(9)
    tokens, targets = (rng.integers(0, cfg.vocab_size, (2, 7)) for _ in range(2))
    want = engine(cfg, p, tokens, targets)[2]

    def run(mode):
        stage = make_stage(cfg=cfg, recompute=mode)
        stage.mtp.weights = mtp_weights(cfg, 2, 7)
        _, cache = stage.forward(p, tokens, np.arange(7), targets,
                                 ahead=_ahead(targets, np.arange(7), 2, np))
        grads = {n: np.zeros_like(v) for n, v in p.items()}
        stage.backward(p, grads, np.full(tokens.shape, 1.0 / tokens.size), cache)
        return grads

    for mode in ("selective", "full"):
        got = run(mode)
        assert all(np.array_equal(got[n], want[n]) for n in p), mode
