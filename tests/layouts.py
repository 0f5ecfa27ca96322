"""Shared by the engine tests, in one process and on 8 ranks: a small model (and its
validation split), its data, runs of the engine and their comparison, and the engine's state
assembled from every rank."""
from __future__ import annotations

import functools

import numpy as np

from mpipar.config import Config, ModelConfig, ParallelConfig, TrainConfig
from mpipar.rules import validate
from mpipar.training import step as trainer

VOCAB = 13  # not a power of two: TP pads it

MODELS = {
    "llama": {},
    # One parameter for the embedding and the LM head, Qwen2's q/k/v biases, and Llama 3.1's
    # RoPE rule with a pretraining context of 8 < seq_len = 16, so that of the 4 frequencies
    # (wavelengths 6.3, 63, 628, 6283) one is interpolated and three are divided by the factor.
    "tied": dict(tie_embeddings=True, attention_bias=True, rope_type="llama3", rope_factor=4.0,
                 rope_original_max_positions=8),
    # Dynamic NTK RoPE scales with the whole sequence (16 > 8), which no SP rank's chunk shows.
    "dynamic": dict(attention_bias=True, rope_type="dynamic", rope_factor=2.0,
                    rope_original_max_positions=8),
    # Sliding windows (seq_len 16): 5 is less than an SP chunk at sp = 2 and more than one at
    # sp = 4 or 8 (several ranks back); "gemma" alternates local (even) and global layers.
    "window": dict(sliding_window=5),
    "gemma": dict(sliding_window=3, window_layers="even"),
    # Qwen3's attention: per-head q/k RMSNorms before RoPE and a head dim of 12, not
    # hidden / heads = 8; and with Qwen3-MoE's experts (blocks 1-3 sparse, no shared expert).
    "qwen3": dict(qk_norm=True, head_dim=12),
    # Gemma 3: local layers 0, 1, 3 (window 3, RoPE base 100, unscaled) and global layer 2
    # (base 10000, linear scaling); q/k norms, four norms per block scaled by 1 + w (starting at
    # 0), the embedding scaled by sqrt(hidden), GeGLU, the attention scale 1/sqrt(10), tied.
    "gemma3": dict(qk_norm=True, head_dim=12, norm_placement="sandwich", norm_unit_offset=True,
                   embed_scale=True, ffn_activation="gelu_tanh", query_pre_attn_scalar=10.0,
                   sliding_window=3, window_layers="0,1,3", rope_local_theta=100.0,
                   rope_type="linear", rope_factor=2.0, tie_embeddings=True),
    "qwen3_moe": dict(qk_norm=True, head_dim=12, moe_experts=4, moe_top_k=2, moe_ffn_hidden=16,
                      moe_layers="1,2,3", moe_aux_loss_coef=0.05),
    # Mixture of experts: blocks 1-3 sparse (4 experts, top 2), block 0 dense; a balance loss
    # strong enough to move the router.
    "moe": dict(moe_experts=4, moe_top_k=2, moe_ffn_hidden=16, moe_layers="1,2,3",
                moe_aux_loss_coef=0.05),
    "moe8": dict(moe_experts=8, moe_top_k=2, moe_ffn_hidden=8, moe_aux_loss_coef=0.05),
    # ... with a shared expert (DeepSeek-V3's) of width 24 in each sparse block, split by tp.
    "moe_shared": dict(moe_experts=4, moe_top_k=2, moe_ffn_hidden=16, moe_layers="1,2,3",
                       moe_aux_loss_coef=0.05, moe_shared_ffn_hidden=24),
    # ... and Qwen2-MoE's sigmoid gate on it.
    "moe_gated": dict(moe_experts=4, moe_top_k=2, moe_ffn_hidden=16, moe_layers="1,2,3",
                      moe_aux_loss_coef=0.05, moe_shared_ffn_hidden=24, moe_shared_gate=True),
    # ... with the top-K weights not renormalised (Qwen1.5-MoE-A2.7B's norm_topk_prob false).
    "moe_qwen": dict(moe_experts=4, moe_top_k=2, moe_ffn_hidden=16, moe_layers="1,2,3",
                     moe_aux_loss_coef=0.05, moe_shared_ffn_hidden=24, moe_shared_gate=True,
                     moe_norm_topk=False),
    # ... with an expert capacity that drops routed assignments (the shared expert takes all).
    "moe_gated_cap": dict(moe_experts=4, moe_top_k=2, moe_ffn_hidden=16, moe_layers="1,2,3",
                          moe_aux_loss_coef=0.05, moe_shared_ffn_hidden=24, moe_shared_gate=True,
                          moe_capacity_factor=0.6),
    # DeepSeek-V3's: multi-head latent attention (a query latent, the down-projections and latent
    # norms whole on every tp rank, values of 6 beside query/key heads of 6 + 4 rope) and the
    # grouped sigmoid router (8 experts in 4 groups, top 2 in the best 2, a routed scale, the
    # balance loss on normalised scores, a selection bias moved each step) with a shared expert.
    "deepseek": dict(kv_heads=4, head_dim=10, latent_kv_rank=8, latent_q_rank=12,
                     rope_head_dim=4, v_head_dim=6, moe_experts=8, moe_top_k=2, moe_ffn_hidden=8,
                     moe_layers="1,2,3", moe_router="grouped_sigmoid", moe_groups=4,
                     moe_topk_groups=2, moe_routed_scale=2.5, moe_shared_ffn_hidden=16,
                     moe_aux_loss_coef=0.05, moe_bias_update_rate=0.01),
    # Multi-token prediction: two modules after the 4 blocks (blocks 4 and 5 by DeepSeek-V3's
    # numbering) on the last stage, sharing the embedding and the LM head.
    "mtp": dict(mtp_depth=2, mtp_loss_coef=0.3),
    # ... with a multi-token prediction module (its block sparse, as the last block).
    "deepseek_mtp": dict(kv_heads=4, head_dim=10, latent_kv_rank=8, latent_q_rank=12,
                         rope_head_dim=4, v_head_dim=6, moe_experts=8, moe_top_k=2,
                         moe_ffn_hidden=8, moe_layers="1,2,3", moe_router="grouped_sigmoid",
                         moe_groups=4, moe_topk_groups=2, moe_routed_scale=2.5,
                         moe_shared_ffn_hidden=16, moe_aux_loss_coef=0.05,
                         moe_bias_update_rate=0.01, mtp_depth=1),
    # ... its latent attention in a dense model (tp sequence parallelism takes no experts).
    "latent": dict(kv_heads=4, head_dim=10, latent_kv_rank=8, latent_q_rank=12, rope_head_dim=4,
                   v_head_dim=6),
}
"""Test models by name: fields of ModelConfig on top of the small model's."""


def small_config(dtype: str = "float64", model: str = "llama", **parallel) -> Config:
    """The test model (``model``: a name of :data:`MODELS`). In float32, AdamW's eps is 1e-4:
    with eps = 1e-8 the first update of an element whose gradient is at float32 round-off level
    is ~lr*sign(g), which turns layout round-off (losses and gradient norms agree to ~5e-8) into
    3e-4 parameter differences; with eps = 1e-4 the update is a smooth function of the gradient
    and parameters agree to ~3e-6. ``--sp-split balanced`` deals chunks down to one token
    (``sp_min_chunk`` 1): the 16-token rows stand in for long ones, whose ranks hold many runs."""
    return Config(
        ModelConfig(**{"vocab_size": VOCAB, "hidden": 32, "layers": 4, "heads": 4, "kv_heads": 2,
                       "ffn_hidden": 48, "init_std": 0.2, **MODELS[model]}),
        ParallelConfig(**{"compression_warmup": 0, "sp_min_chunk": 1, **parallel}), # compress from step 1
        TrainConfig(steps=2, seq_len=16, global_batch_size=8, micro_batch_size=1, lr=1e-2,
                    min_lr=1e-3, warmup_steps=1, clip_grad=0.5, dtype=dtype, backend="numpy",
                    seed=11, eps=1e-4 if dtype == "float32" else 1e-8),
    )


EVAL_FRACTION, EVAL_BATCHES = 0.25, 2
"""The validation split of the test model's 64 samples: 16 held out = 2 batches of 8."""


def eval_config(dtype: str = "float64", **parallel) -> Config:
    """The test model (:func:`small_config`) validating on :data:`EVAL_BATCHES` batches of a
    held-out :data:`EVAL_FRACTION` of its samples."""
    cfg = small_config(dtype, **parallel)
    cfg.train.eval_fraction, cfg.train.eval_batches = EVAL_FRACTION, EVAL_BATCHES
    return cfg


@functools.lru_cache(maxsize=None)
def token_source(seq_len: int = 16):
    import tempfile, os
    rng = np.random.default_rng(3)
    samples = rng.integers(0, VOCAB, size=(64, seq_len + 1))
    path = os.path.join(tempfile.mkdtemp(prefix="mpipar-test-"), "samples.npy")
    np.save(path, samples)
    from mpipar.data.sources import load_tokens
    return load_tokens(path, VOCAB, seq_len)


def run(cfg: Config, comm, steps: int = 2, results: list | None = None):
    """Train ``steps`` steps on ``comm``; return (losses, grad norms, gathered params, rank);
    ``results``: a list the steps' StepResults are appended to."""
    from mpipar.training.rank import build_rank
    rank = build_rank(validate(cfg, comm.Get_size()), comm, source=token_source(cfg.train.seq_len))
    results = results if results is not None else []
    results += [trainer.train_step(rank, k) for k in range(steps)]
    return ([r.loss for r in results], [r.grad_norm for r in results], trainer.gather_params(rank), rank)


@functools.lru_cache(maxsize=None)
def reference(dtype: str = "float64", steps: int = 2, model: str = "llama"):
    """The single-process run (computed once per process)."""
    from mpi4py import MPI
    results = REFERENCE_RESULTS.setdefault((dtype, steps, model), [])
    losses, norms, params, rank = run(small_config(dtype, model), MPI.COMM_SELF, steps, results)
    trainer.close(rank)
    return losses, norms, params


REFERENCE_RESULTS: dict[tuple, list] = {}
"""The single-process runs' StepResults by (dtype, steps, model), filled by :func:`reference`."""


def layout_name(layout: dict) -> str:
    """A test id for a layout dict, e.g. ``dp2-tp2-schedulezb-h1``."""
    return "-".join(f"{k}{v}" for k, v in layout.items())


def layout_size(layout: dict) -> int:
    """Ranks a layout dict needs (dp * tp * pp * sp, missing axes = 1)."""
    size = 1
    for axis in ("dp", "tp", "pp", "sp"):
        size *= layout.get(axis, 1)
    return size


def compare(got, ref, tol: float) -> list[str]:
    """Relative differences above ``tol`` between two runs' (losses, norms, params)."""
    fails = []
    for what, a, b in (("loss", got[0], ref[0]), ("grad_norm", got[1], ref[1])):
        for i, (x, y) in enumerate(zip(a, b)):
            if abs(x - y) > tol * abs(y):
                fails.append(f"{what}[{i}] {x!r} vs {y!r}")
    for name, want in ref[2].items():
        err = np.abs(got[2][name] - want).max() / max(np.abs(want).max(), 1e-300)
        if not err <= tol:
            fails.append(f"{name}: rel err {err:.3g}")
    return fails


def global_state(rank, world) -> dict[tuple[str, str], np.ndarray]:
    """Every global tensor of params and AdamW moments (and residuals) by (kind, name), each of
    the parameter's global shape, assembled from all ranks' unique pieces (NaN where no rank
    holds an element); fails if an element is reported twice. Collective over ``world``."""
    mine = []
    for kind, name, lo, hi, values in rank.state.pieces():
        region, valid = rank.state.region(name)
        mine.append((kind, name, region, valid, rank.state.local_shape(name), (lo, hi),
                     values.copy()))
    out: dict[tuple[str, str], np.ndarray] = {}
    for items in world.allgather(mine):
        for kind, name, region, valid, local_shape, flat_range, values in items:
            arr = out.setdefault((kind, name), np.full(rank.state.shapes[name], np.nan))
            flat = np.full(int(np.prod(local_shape)), np.nan)  # a flat range of that rank's shard
            flat[flat_range[0]:flat_range[1]] = values
            block = flat.reshape(local_shape)[valid]
            target = arr[region]
            assert np.isnan(target[~np.isnan(block)]).all(), f"{kind}/{name} reported twice"
            target[~np.isnan(block)] = block[~np.isnan(block)]
    return out
