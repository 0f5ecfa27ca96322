"""The Llama decoder as a stage of layers with explicit forward and backward (no autograd).

A :class:`LlamaStage` holds a contiguous run of decoder blocks and, on the first pipeline stage,
the embedding, and on the last the final norm, LM head and cross-entropy. With one process a
single stage holds everything. Parallelism enters only through three seams:

- ``tp``: a :class:`mpipar.comm.Group`; the column/row-parallel linears all-reduce over it
  (Megatron's f/g operators) and the vocabulary-parallel embedding and loss reduce over it;
- ``attention``: the attention core (:class:`LocalAttention` here, ring or Ulysses attention
  over SP from :mod:`mpipar.parallel`), which sees this rank's query chunk and global positions;
- positions: RoPE uses the global token positions of this rank's sequence chunk.

Shapes: ``B`` microbatch, ``S`` local sequence length, ``H`` hidden, ``hq``/``hkv`` the query/kv
heads on this TP rank, ``D`` head_dim, ``F`` local FFN width, ``Vl`` local vocabulary rows.

What forward keeps for backward (``recompute``), per block; backward rebuilds the rest with the
same kernel calls on the same inputs, so every mode gives bit-identical results:

- ``none``: block input ``x``, ``h1 = RMSNorm(x)``, the attention core's context (its q, k, v
  after RoPE, output and log-sum-exp), ``x2`` (residual after attention), ``h2 = RMSNorm(x2)``,
  ``g``, ``u`` (gate/up projections) and ``m = SwiGLU(g, u)``, plus the two norms' ``rstd``.
- ``selective``: ``x``, ``x2``, the attention output and log-sum-exp, ``g`` and ``u``. Dropped and
  recomputed in backward, none of it needing communication: both RMSNorms (``h1``, ``h2``, their
  ``rstd``), the q/k/v projections of ``h1`` and RoPE, and ``m = SwiGLU(g, u)``. q, k, v are
  dropped when the attention core's context starts with the very q, k, v it was given, as local
  and ring attention do (Ulysses' context holds all-to-all'ed copies, which are kept); when the
  context's fourth entry is the very output returned, o_proj's input is re-derived from it
  instead of kept a second time (a reshape, a copy when the kernel's output is not contiguous).
- ``full``: only ``x``; backward re-runs the whole block forward first, which repeats its TP
  all-reduces and SP ring/all-to-all traffic (the ledger counts it; the planner does not).
- ``offload``: what ``none`` keeps, written to a :class:`CacheStore` (a per-rank HDF5 scratch
  file, :class:`mpipar.activations.OffloadStore`) block by block during forward and read back
  block by block in backward; the LM head's context too.

RoPE tables come from a per-stage cache keyed by positions in every mode.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mpipar.config import ModelConfig
from mpipar.comm import Group
from mpipar.model.params import block_param_specs, padded_vocab, stage_param_names


RECOMPUTE_MODES = ("none", "selective", "full", "offload")

ACTIVATION_NAMES = ("input", "attention", "attention_out", "mlp", "output")
"""What a recorder receives per block: ``input`` ``[B, S, H]`` (block input), ``attention``
``[B, S, hq*D]`` (attention output before o_proj: this TP rank's heads), ``attention_out``
``[B, S, H]`` (after o_proj and the TP all-reduce), ``mlp`` ``[B, S, H]`` (MLP output after
down_proj and the TP all-reduce) and ``output`` ``[B, S, H]`` (block output)."""


class CacheStore(Protocol):
    """Somewhere off the working set to keep saved activations between forward and backward."""

    def put(self, tree: Any) -> Any:
        """Store a nested structure (dict/list/tuple of arrays and scalars); return its handle."""

    def take(self, handle: Any) -> Any:
        """Return the structure stored under ``handle`` and forget it."""


class AttentionCore(Protocol):
    """Causal attention of this rank's queries over the whole (possibly distributed) sequence."""

    def forward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                positions: np.ndarray) -> tuple[np.ndarray, Any]:
        """q ``[B, S, hq, D]``, k/v ``[B, S, hkv, D]`` -> (out ``[B, S, hq, D]``, saved context)."""

    def backward(self, dout: np.ndarray, ctx: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """dout ``[B, S, hq, D]`` -> (dq, dk, dv) for this rank's q, k, v."""


class LocalAttention:
    """Attention over a sequence held entirely by this rank (no SP)."""

    def __init__(self, kernels) -> None:
        self.k = kernels

    def forward(self, q, k, v, positions):
        offset = int(positions[0])
        out, lse = self.k.attention_fwd(q, k, v, offset, offset, True)
        return out, (q, k, v, out, lse, offset)

    def backward(self, dout, ctx):
        q, k, v, out, lse, offset = ctx
        return self.k.attention_bwd(q, k, v, out, lse, dout, offset, offset, True)


@dataclass
class VocabShard:
    """The rows ``[start, start + local)`` of the (padded) vocabulary held by this TP rank."""

    start: int
    local: int
    size: int  # true vocabulary size (ids >= size are padding)

    @classmethod
    def of(cls, vocab_size: int, tp: Group) -> "VocabShard":
        local = padded_vocab(vocab_size, tp.size) // tp.size
        return cls(tp.rank * local, local, vocab_size)


class LlamaStage:
    """Blocks ``layers`` of the model, plus embedding (``first``) and norm/head/loss (``last``)."""

    def __init__(self, cfg: ModelConfig, kernels, layers: range, first: bool, last: bool,
                 tp: Group, attention: AttentionCore, recompute: str = "none",
                 store: CacheStore | None = None) -> None:
        """``recompute`` in :data:`RECOMPUTE_MODES` (see the module docstring); ``offload``
        needs ``store``. ``recorder``, when set to a callable ``(layer, name, array)``, receives
        the :data:`ACTIVATION_NAMES` tensors of every block the forward pass runs."""
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={recompute!r}: must be one of "
                             f"{', '.join(RECOMPUTE_MODES)}")
        if recompute == "offload" and store is None:
            raise ValueError("recompute='offload': needs a store for the saved activations")
        self.recompute, self.store = recompute, store
        self.recorder = None
        self.cfg = cfg.resolved()
        self.k, self.layers, self.first, self.last = kernels, layers, first, last
        self.tp, self.attention = tp, attention
        self.vocab = VocabShard.of(self.cfg.vocab_size, tp)
        self.hq = self.cfg.heads // tp.size
        self.hkv = self.cfg.kv_heads // tp.size
        self._rope: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
        self._deferred: list | None = None

    # ---------------------------------------------------------------- helpers
    def param_names(self) -> list[str]:
        return stage_param_names(self.cfg, self.layers, self.first, self.last)

    def _cos_sin(self, positions: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
        key = positions.tobytes() + np.dtype(dtype).str.encode()
        if key not in self._rope:
            self._rope[key] = self.k.rope_cos_sin(positions, self.cfg.head_dim,
                                                  self.cfg.rope_theta, dtype)
        return self._rope[key]

    # ---------------------------------------------------------------- forward
    def forward(self, params: dict[str, np.ndarray], inp: np.ndarray, positions: np.ndarray,
                targets: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
        """Run the stage.

        inp: token ids ``[B, S]`` on the first stage, else the activation ``[B, S, H]``.
        positions: global positions ``[S]`` of this rank's tokens. targets ``[B, S]`` on the last.
        Returns ``[B, S, H]``, or on the last stage the per-token loss ``[B, S]`` (float64).
        """
        cache: dict[str, Any] = {"positions": positions}
        x = self._embed_fwd(params, inp, cache) if self.first else inp
        cache["blocks"] = []
        for i in self.layers:
            y, c = self._block_fwd(params, i, x, positions)
            if self.recorder is not None:
                for name, value in zip(ACTIVATION_NAMES, (x, c["o"], c["a"], c["y"], y)):
                    self.recorder(i, name, value)
            cache["blocks"].append(self._save_block(c))
            x = y
        if not self.last:
            return x, cache
        loss = self._head_fwd(params, x, targets, cache)
        if self.recompute == "offload":
            cache["head"] = self.store.put(cache["head"])
        return loss, cache

    def _save_block(self, c: dict) -> Any:
        """What this block keeps for backward under ``self.recompute`` (module docstring)."""
        keep = ("x", "h1", "rstd1", "actx", "o", "x2", "h2", "rstd2", "g", "u", "m")
        if self.recompute == "none":
            return {n: c[n] for n in keep}
        if self.recompute == "offload":
            return self.store.put({n: c[n] for n in keep})
        if self.recompute == "full":
            return {"x": c["x"]}
        actx = c["actx"]
        inputs = isinstance(actx, tuple) and len(actx) >= 4 and all(
            a is b for a, b in zip(actx[:3], c["qkv"]))
        # A context (q, k, v, out, ...) also holds the output o_proj reads (reshaped).
        o_in_ctx = inputs and actx[3] is c["o_core"]
        return dict(x=c["x"], x2=c["x2"], o=None if o_in_ctx else c["o"], g=c["g"], u=c["u"],
                    actx=actx[3:] if inputs else actx, qkv_dropped=inputs)

    def _restore_block(self, params, i: int, saved: Any, positions: np.ndarray) -> dict:
        """The block cache ``_block_bwd`` needs, rebuilt from what :meth:`_save_block` kept."""
        if self.recompute == "full":
            c = self._block_fwd(params, i, saved["x"], positions)[1]
        elif self.recompute == "offload":
            c = self.store.take(saved)
        else:
            c = saved
        if self.recompute == "selective":
            k, p, n = self.k, params, f"layers.{i}."
            c = dict(c)
            c["h1"], c["rstd1"] = k.rmsnorm_fwd(c["x"], p[n + "input_layernorm.weight"],
                                                self.cfg.norm_eps)
            if c.pop("qkv_dropped"):
                c["actx"] = self._qkv(params, i, c["h1"], positions) + tuple(c["actx"])
            if c["o"] is None:
                B, S, _ = c["x"].shape
                c["o"] = c["actx"][3].reshape(B, S, self.hq * self.cfg.head_dim)
            c["h2"], c["rstd2"] = k.rmsnorm_fwd(c["x2"], p[n + "post_attention_layernorm.weight"],
                                                self.cfg.norm_eps)
            c["m"] = k.swiglu_fwd(c["g"], c["u"])
        c["cos"], c["sin"] = self._cos_sin(positions, c["x"].dtype)
        return c

    def _embed_fwd(self, params, tokens, cache) -> np.ndarray:
        w = params["embed_tokens.weight"]
        local = tokens - self.vocab.start
        mine = (local >= 0) & (local < self.vocab.local)
        x = w[np.where(mine, local, 0)]
        if self.tp.size > 1:
            x *= mine[..., None]
            self.tp.allreduce_(x)
        cache["embed"] = (local, mine)
        return x

    def _qkv(self, params, i, h1, positions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q ``[B, S, hq, D]`` and k ``[B, S, hkv, D]`` after RoPE, v ``[B, S, hkv, D]``, of
        ``h1 = RMSNorm(x)`` ``[B, S, H]`` (column-parallel: no communication)."""
        k, p, n = self.k, params, f"layers.{i}."
        B, S, _ = h1.shape
        D = self.cfg.head_dim
        q = k.linear_fwd(h1, p[n + "self_attn.q_proj.weight"]).reshape(B, S, self.hq, D)
        kk = k.linear_fwd(h1, p[n + "self_attn.k_proj.weight"]).reshape(B, S, self.hkv, D)
        v = k.linear_fwd(h1, p[n + "self_attn.v_proj.weight"]).reshape(B, S, self.hkv, D)
        cos, sin = self._cos_sin(positions, h1.dtype)
        return k.rope_fwd(q, cos, sin), k.rope_fwd(kk, cos, sin), v

    def _block_fwd(self, params, i, x, positions):
        """Block ``i`` on ``x`` ``[B, S, H]`` -> (output ``[B, S, H]``, every intermediate)."""
        k, p = self.k, params
        n = f"layers.{i}."
        B, S, _ = x.shape
        D = self.cfg.head_dim
        h1, rstd1 = k.rmsnorm_fwd(x, p[n + "input_layernorm.weight"], self.cfg.norm_eps)
        q, kk, v = self._qkv(params, i, h1, positions)
        o_core, actx = self.attention.forward(q, kk, v, positions)
        o = o_core.reshape(B, S, self.hq * D)
        a = self.tp.allreduce_(k.linear_fwd(o, p[n + "self_attn.o_proj.weight"]))
        x2 = x + a
        h2, rstd2 = k.rmsnorm_fwd(x2, p[n + "post_attention_layernorm.weight"], self.cfg.norm_eps)
        g = k.linear_fwd(h2, p[n + "mlp.gate_proj.weight"])
        u = k.linear_fwd(h2, p[n + "mlp.up_proj.weight"])
        m = k.swiglu_fwd(g, u)
        y = self.tp.allreduce_(k.linear_fwd(m, p[n + "mlp.down_proj.weight"]))
        cache = dict(x=x, h1=h1, rstd1=rstd1, qkv=(q, kk, v), actx=actx, o_core=o_core, o=o, a=a,
                     x2=x2, h2=h2, rstd2=rstd2, g=g, u=u, m=m, y=y)
        return x2 + y, cache

    def _head_fwd(self, params, x, targets, cache) -> np.ndarray:
        k = self.k
        B, S, H = x.shape
        hn, rstd = k.rmsnorm_fwd(x, params["norm.weight"], self.cfg.norm_eps)
        logits = k.linear_fwd(hn.reshape(B * S, H), params["lm_head.weight"])
        t = targets.reshape(B * S)
        # Vocabulary-parallel cross-entropy: never gather the logits, reduce three numbers a token.
        m, s, tl = k.cross_entropy_stats(logits, t, self.vocab.start, self.vocab.size)
        if self.tp.size > 1:
            gmax = self.tp.allreduce_max_(m.copy())  # in place: keep the local max for rescaling
            packed = self.tp.allreduce_(np.stack([s * np.exp(m - gmax), tl]))
            m, s, tl = gmax, packed[0], packed[1]
        lse = m + np.log(s)
        cache["head"] = (x, hn, rstd, logits, t, lse)
        return (lse - tl).astype(np.float64).reshape(B, S)

    # ---------------------------------------------------------------- backward
    def backward(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray],
                 dout: np.ndarray, cache: dict, deferred: list | None = None,
                 on_ready=None) -> np.ndarray | None:
        """Accumulate parameter gradients into ``grads`` (+=) and return d(input).

        dout: ``[B, S, H]``, or on the last stage the weight of each token's loss ``[B, S]``
        (``1 / tokens in the global batch`` for the mean loss). Returns ``[B, S, H]``, or None on
        the first stage (token ids have no gradient).

        deferred: if a list is given, the weight gradients of the linear layers are not computed
        but appended to it as ``(name, dy, x)`` for :meth:`weight_backward` to run later (the
        input-gradient / weight-gradient split of zero-bubble schedules).
        on_ready: called with the list of parameter names whose gradients this call has finished,
        after each block (the hook that launches data-parallel bucket reductions early).
        """
        self._deferred = deferred
        notify = on_ready if deferred is None else None
        if self.last:
            dx = self._head_bwd(params, grads, dout, cache)
            notify and notify(["norm.weight", "lm_head.weight"])
        else:
            dx = dout
        blocks = cache["blocks"]
        for i in reversed(self.layers):  # pop: each block's activations go once it is done
            c = self._restore_block(params, i, blocks.pop(), cache["positions"])
            dx = self._block_bwd(params, grads, i, dx, c)
            notify and notify([s.name for s in block_param_specs(self.cfg, i)])
        self._deferred = None
        if self.first:
            self._embed_bwd(grads, dx, cache)
            notify and notify(["embed_tokens.weight"])
            return None
        return dx

    def weight_backward(self, grads: dict[str, np.ndarray], deferred: list) -> None:
        """Run the weight-gradient GEMMs that :meth:`backward` deferred."""
        for name, dy, x in deferred:
            grads[name] += dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        deferred.clear()

    def _linear_bwd(self, dy, x, w, name, grads) -> np.ndarray:
        """d(input) of ``y = x @ w.T``; the weight gradient now, or deferred (see backward)."""
        if self._deferred is None:
            dx, dw = self.k.linear_bwd(dy, x, w)
            grads[name] += dw
            return dx
        self._deferred.append((name, dy, x))
        return dy @ w

    def _head_bwd(self, params, grads, dloss, cache) -> np.ndarray:
        k = self.k
        head = cache["head"]
        x, hn, rstd, logits, t, lse = (self.store.take(head) if self.recompute == "offload"
                                       else head)
        B, S, H = x.shape
        dlogits = k.cross_entropy_bwd(logits, t, lse, dloss.reshape(B * S).astype(lse.dtype),
                                      self.vocab.start, self.vocab.size).astype(x.dtype)
        dhn = self._linear_bwd(dlogits, hn.reshape(B * S, H), params["lm_head.weight"],
                               "lm_head.weight", grads)
        self.tp.allreduce_(dhn)
        dx, dwn = k.rmsnorm_bwd(dhn.reshape(B, S, H), x, params["norm.weight"], rstd)
        grads["norm.weight"] += dwn
        return dx

    def _block_bwd(self, params, grads, i, dout, c) -> np.ndarray:
        k, p, n = self.k, params, f"layers.{i}."
        B, S, H = dout.shape
        D = self.cfg.head_dim
        lin = self._linear_bwd
        dm = lin(dout, c["m"], p[n + "mlp.down_proj.weight"], n + "mlp.down_proj.weight", grads)
        dg, du = k.swiglu_bwd(dm, c["g"], c["u"])
        dh2 = lin(dg, c["h2"], p[n + "mlp.gate_proj.weight"], n + "mlp.gate_proj.weight", grads)
        dh2 += lin(du, c["h2"], p[n + "mlp.up_proj.weight"], n + "mlp.up_proj.weight", grads)
        dh2 = self.tp.allreduce_(dh2)
        dx2, dw = k.rmsnorm_bwd(dh2, c["x2"], p[n + "post_attention_layernorm.weight"], c["rstd2"])
        grads[n + "post_attention_layernorm.weight"] += dw
        dx2 = dx2 + dout
        do = lin(dx2, c["o"], p[n + "self_attn.o_proj.weight"], n + "self_attn.o_proj.weight", grads)
        dq, dk, dv = self.attention.backward(do.reshape(B, S, self.hq, D), c["actx"])
        dq, dk = k.rope_bwd(dq, c["cos"], c["sin"]), k.rope_bwd(dk, c["cos"], c["sin"])
        dh1 = lin(dq.reshape(B, S, -1), c["h1"], p[n + "self_attn.q_proj.weight"],
                  n + "self_attn.q_proj.weight", grads)
        dh1 += lin(dk.reshape(B, S, -1), c["h1"], p[n + "self_attn.k_proj.weight"],
                   n + "self_attn.k_proj.weight", grads)
        dh1 += lin(dv.reshape(B, S, -1), c["h1"], p[n + "self_attn.v_proj.weight"],
                   n + "self_attn.v_proj.weight", grads)
        self.tp.allreduce_(dh1)
        dx, dw = k.rmsnorm_bwd(dh1, c["x"], p[n + "input_layernorm.weight"], c["rstd1"])
        grads[n + "input_layernorm.weight"] += dw
        return dx + dx2

    def _embed_bwd(self, grads, dx, cache) -> None:
        local, mine = cache["embed"]
        g = grads["embed_tokens.weight"]
        H = dx.shape[-1]
        rows = dx.reshape(-1, H)[mine.reshape(-1)]
        np.add.at(g, local.reshape(-1)[mine.reshape(-1)], rows.astype(g.dtype))
