"""Cost model of a layout: what one optimizer step sends, per rank and per group.

``predict_step_bytes(cfg, coord)`` derives, from the layer shapes alone, the bytes this rank hands
to MPI in one training step for every group of the grid, under the ledger's counting convention
(:mod:`mpipar.comm`: the payload of each call, sender side). The tests hold the engine's ledger to
these numbers exactly, so the model and the implementation cannot drift apart.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from mpipar.config import Config
from mpipar.model.params import padded_vocab, param_specs
from mpipar.parallel.grads import padded_size, plan_buckets
from mpipar.topology import Coord


def local_param_shapes(cfg: Config, coord: Coord) -> dict[str, tuple[int, ...]]:
    """Shapes of the parameter shards held by the rank at ``coord``, in forward order."""
    m, par = cfg.model.resolved(), cfg.parallel
    p, v = par.pp, par.virtual_stages
    per = m.layers // (p * v)
    stages = [c * p + coord.pp for c in range(v)]
    out = {}
    for spec in param_specs(m):
        if spec.layer is None:
            stage = 0 if spec.name == "embed_tokens.weight" else p * v - 1
        else:
            stage = spec.layer // per
        if stage not in stages:
            continue
        shape = list(spec.shape)
        if spec.tp_axis is not None:
            if spec.vocab_parallel:
                shape[0] = padded_vocab(shape[0], par.tp)
            shape[spec.tp_axis] //= par.tp
        out[spec.name] = tuple(shape)
    return out


def _chunk_order(cfg: Config, coord: Coord) -> list[str]:
    """Parameter names of this rank in the order the engine lays them out (chunk by chunk)."""
    m, par = cfg.model.resolved(), cfg.parallel
    p, v = par.pp, par.virtual_stages
    per = m.layers // (p * v)
    names = []
    for c in range(v):
        s = c * p + coord.pp
        if s == 0:
            names.append("embed_tokens.weight")
        for i in range(s * per, (s + 1) * per):
            names += [x.name for x in param_specs(m) if x.layer == i]
        if s == p * v - 1:
            names += ["norm.weight", "lm_head.weight"]
    return names


def predict_step_bytes(cfg: Config, coord: Coord) -> dict[str, int]:
    """Bytes per group that the rank at ``coord`` hands to MPI in one step (resolved ``cfg``)."""
    m, par, tr = cfg.model.resolved(), cfg.parallel, cfg.train
    e = np.dtype(tr.dtype).itemsize
    se = 8 if tr.dtype == "float64" else 4          # softmax statistics dtype
    b, s_loc = tr.micro_batch_size, tr.seq_len // par.sp
    n_tok, H, D = b * s_loc, m.hidden, m.head_dim
    micro = tr.global_batch_size // (par.dp * b)
    p, v = par.pp, par.virtual_stages
    per = m.layers // (p * v)
    stages = [c * p + coord.pp for c in range(v)]
    blocks = per * len(stages)
    first, last = 0 in stages, (p * v - 1) in stages
    out: dict[str, int] = defaultdict(int)

    if par.tp > 1:
        tp = 4 * n_tok * H * e * blocks                      # 2 all-reduces fwd, 2 bwd per block
        tp += n_tok * H * e if first else 0                  # vocab-parallel embedding
        tp += (3 * n_tok * se + n_tok * H * e) if last else 0  # max, (sum-exp, target), d(hidden)
        out["tp"] = tp * micro
    if par.sp > 1:
        q = b * s_loc * (m.heads // par.tp) * D * e
        kv = b * s_loc * (m.kv_heads // par.tp) * D * e
        if par.sp_mode == "ulysses":
            per_block = 4 * q + 4 * kv                       # q,k,v,out fwd; dout,dq,dk,dv bwd
        else:
            per_block = (par.sp - 1) * 2 * kv + (par.sp - 1) * 4 * kv + 2 * kv
        out["sp"] = per_block * blocks * micro
    if p > 1:
        act = n_tok * H * e
        sends = sum((s < p * v - 1) + (s > 0) for s in stages) * micro
        out["pp"] = sends * act + (8 if coord.pp == p - 1 else 0)  # + the loss broadcast
    group = par.dp * par.sp
    if group > 1:
        shapes = local_param_shapes(cfg, coord)
        order = list(reversed(_chunk_order(cfg, coord)))
        sizes = [int(np.prod(shapes[n])) for n in order]
        limit = max(1, int(par.bucket_mb * 2**20))
        lengths = [padded_size(sum(sizes[i] for i in idx), group)
                   for idx in plan_buckets([s * e for s in sizes], limit)]
        if par.zero:
            out["dp_sp"] = sum(L * e + (L // group) * e for L in lengths) + 8 + 8  # + loss, norm
        else:
            out["dp_sp"] = sum(L * e for L in lengths) + 8                      # + loss
    if par.tp * p > 1:
        out["tp_pp"] = 8                                      # the squared gradient norm
    return dict(out)
