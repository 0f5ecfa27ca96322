"""The attention core a decoder block calls, and the one that needs no other rank.

A block computes q, k, v (after RoPE) for its tokens and hands them to an *attention core*:
:class:`LocalAttention` here when one rank holds the whole sequence, or ring / Ulysses attention
over sequence parallelism (:mod:`mpipar.parallel.sequence`). A core says explicitly what its
backward reads, so the block's recomputation knows what it may drop:

- ``forward(q, k, v, positions, window) -> (out, saved)``: ``saved`` is what the core keeps
  beyond the block's own tensors (the lse, or Ulysses' all-to-all'ed copies); ``window`` is the
  block's sliding window (a query sees itself and the ``window - 1`` positions before it; 0 =
  full causal), which may differ from layer to layer;
- ``backward(dout, q, k, v, out, saved, window) -> (dq, dk, dv)``, in the dtype of the
  activations: the kernels' gradients are float32 under bf16 compute, and a core sums partial
  results (blocks of a ring, halos) in :func:`accumulator` dtype and rounds each gradient once,
  where it becomes an activation gradient (before a message that carries it as one);
- ``needs_inputs``: whether backward reads q, k, v (and ``out``) as given. When it does, the
  block keeps them (``--recompute none``) or recomputes q, k, v from its input
  (``selective``); when it does not, the block keeps none of them and passes None;
- ``passes_latent``: whether the core takes latent attention's blocks as latents (the ring,
  :class:`mpipar.model.latent_attention.LatentBlocks`): its forward and backward then take
  ``latent=`` and its backward returns the latent's gradient in place of dk (dv None).

Shapes: q ``[B, S, hq, D]``, k/v ``[B, S, hkv, D]``, out ``[B, S, hq, D]``, lse ``[B, hq, S]``.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from mpipar.runtime.precision import is_bf16

Array = Any


def accumulator(dtype: Any) -> np.dtype:
    """The dtype partial results of activations of ``dtype`` are summed in (attention blocks and
    their gradients, RoPE tables): float32 for bfloat16 (rounded once, at the end), else the
    dtype itself."""
    return np.dtype(np.float32) if is_bf16(dtype) else np.dtype(dtype)


def as_activations(grads: tuple[Array, ...], like: Array) -> tuple[Array, ...]:
    """``grads`` in the dtype of the activation ``like`` (one rounding under bf16; no copy
    otherwise)."""
    return tuple(g.astype(like.dtype, copy=False) for g in grads)


def grads_as_activations(like: Array) -> Any:
    """The ``grad_dtype`` a caller of :func:`attend_bwd` that keeps its gradients as they are
    (then :func:`as_activations`) asks for: bf16 activations' own dtype (kernels that can write
    bf16 gradients skip the float32 copy and its cast: the same bits); else None (the kernels'
    gradients are already the activations' dtype)."""
    return like.dtype if is_bf16(like.dtype) else None


class AttentionCore(Protocol):
    """Causal attention of this rank's queries over the whole (possibly distributed) sequence."""

    needs_inputs: bool
    passes_latent: bool

    def forward(self, q: Array, k: Array, v: Array,
                positions: np.ndarray) -> tuple[Array, Any]:
        """q ``[B, S, hq, D]``, k/v ``[B, S, hkv, D]``, global positions ``[S]`` -> (out, saved)."""

    def backward(self, dout: Array, q: Array | None, k: Array | None, v: Array | None,
                 out: Array, saved: Any) -> tuple[Array, Array, Array]:
        """dout ``[B, S, hq, D]`` -> (dq, dk, dv) for this rank's q, k, v."""


class LocalAttention:
    """Attention over a sequence held entirely by this rank (no SP): saves the lse only."""

    needs_inputs = True
    passes_latent = False

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    def forward(self, q: Array, k: Array, v: Array, positions: np.ndarray,
                window: int = 0) -> tuple[Array, Any]:
        offset, docs = int(positions[0]), documents_of(positions)
        out, lse = attend_fwd(self.kernels, q, k, v, offset, offset, window, docs)
        return out, (lse, offset, docs)

    def backward(self, dout, q, k, v, out, saved, window: int = 0):
        lse, offset, docs = saved
        return as_activations(attend_bwd(self.kernels, q, k, v, out, lse, dout, offset, offset,
                                         window, docs, grads_as_activations(q)), q)


# ------------------------------------------------------------------------------- packed documents
def runs_visible(qs: int, qn: int, ks: int, kn: int, window: int) -> bool:
    """Whether some key of the run ``[ks, ks + kn)`` is visible to some query of
    ``[qs, qs + qn)``: causal (key <= query) and, with a window W > 0, query - key < W."""
    return qn > 0 and kn > 0 and ks <= qs + qn - 1 and (window == 0 or qs - (ks + kn - 1) < window)


def document_ids(tokens: np.ndarray, eos: int) -> np.ndarray:
    """Document of every position of packed samples ``tokens [B, S]`` -> int64 ``[B, S]``: an
    EOS belongs to the document it ends, the next token starts a new one (ids from 0 per row)."""
    ends = np.asarray(tokens) == eos
    ids = np.zeros(ends.shape, np.int64)
    ids[:, 1:] = np.cumsum(ends[:, :-1], axis=1)     # EOS seen strictly before each position
    return ids


def document_offsets(docs: np.ndarray) -> np.ndarray:
    """Each position's offset inside its document ``[B, S]`` int64, for document ids ``docs
    [B, S]`` (of :func:`document_ids`: a document is a run of one id): RoPE's positions under
    document masking; a causal query there sees ``offset + 1`` keys of its document."""
    docs = np.asarray(docs)
    first = np.ones(docs.shape, bool)
    first[:, 1:] = docs[:, 1:] != docs[:, :-1]
    at = np.arange(docs.shape[1])
    return at - np.maximum.accumulate(np.where(first, at, 0), axis=1)


class DocumentPositions(np.ndarray):
    """This rank's global positions ``[S_loc]`` (an int array like any positions, and used as
    one) that also carry the documents of the whole packed microbatch: ``docs [B, S]`` (of
    :func:`document_ids`), ``ranges[b]`` the (start, end) of row b's documents ``[n_b, 2]`` and
    ``rope [B, S_loc]`` each token's position inside its document (RoPE's positions).
    Built once per microbatch by :func:`mpipar.data.packing.microbatch_positions` (host
    metadata)."""

    docs: np.ndarray
    ranges: list
    rope: np.ndarray
    memo: dict
    layout: Any     # --sp-split balanced: this microbatch's sequence split (else None)

    @classmethod
    def of(cls, positions: np.ndarray, docs: np.ndarray, layout: Any = None
           ) -> "DocumentPositions":
        out = np.asarray(positions, dtype=np.int64).view(cls)
        out.layout = layout
        out.docs = np.asarray(docs, dtype=np.int64)
        out.memo = {}                  # what is derived once per microbatch (`remember`)
        S = out.docs.shape[1]
        out.ranges = []
        for row in out.docs:
            cut = np.concatenate([[0], np.flatnonzero(np.diff(row)) + 1, [S]])
            out.ranges.append(np.stack([cut[:-1], cut[1:]], axis=1))
        out.rope = document_offsets(out.docs)[:, np.asarray(positions)]
        return out

    def __array_finalize__(self, obj) -> None:
        self.docs = getattr(obj, "docs", None)
        self.ranges = getattr(obj, "ranges", None)
        self.rope = getattr(obj, "rope", None)
        self.memo = getattr(obj, "memo", None)
        self.layout = getattr(obj, "layout", None)

    def remember(self, key: tuple, make: Any) -> Any:
        """``make()``, found once per microbatch under ``key`` (``memo``: every layer asks
        again for what depends only on the documents)."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def with_positions(self, positions: np.ndarray) -> "DocumentPositions":
        """The same documents for other positions of the sequence (``[S']``)."""
        out = DocumentPositions.of(positions, self.docs, self.layout)
        out.memo = self.memo
        return out


def documents_of(positions: Any) -> DocumentPositions | None:
    """``positions`` if they carry documents (``--document-masking``), else None."""
    return positions if isinstance(positions, DocumentPositions) else None


def shared_runs(docs: DocumentPositions, qs: int, qn: int, ks: int, kn: int, window: int
                ) -> tuple[tuple[int, int, int, int, int], ...]:
    """(row, q0, q1, k0, k1), global half-open ranges: for each row and each document met by
    both the query run ``[qs, qs + qn)`` and the key run ``[ks, ks + kn)``, its queries and keys
    there, when some of those keys are visible to some of those queries. Empty: the block has no
    same-document pair (it is skipped, neither computed nor, on a ring, needed). Found once per
    microbatch and block (``docs.remember``)."""
    return docs.remember(("shared_runs", qs, qn, ks, kn, window),
                         lambda: _shared_runs(docs, qs, qn, ks, kn, window))


def _shared_runs(docs: DocumentPositions, qs: int, qn: int, ks: int, kn: int, window: int
                 ) -> tuple[tuple[int, int, int, int, int], ...]:
    out = []
    for b, rng in enumerate(docs.ranges):
        hit = (rng[:, 0] < min(qs + qn, ks + kn)) & (rng[:, 1] > max(qs, ks))
        for s, e in rng[hit]:
            q0, q1, k0, k1 = max(s, qs), min(e, qs + qn), max(s, ks), min(e, ks + kn)
            if runs_visible(q0, q1 - q0, k0, k1 - k0, window):
                out.append((b, int(q0), int(q1), int(k0), int(k1)))
    return tuple(out)


def documents_in_kernel(kernels, dtype: Any) -> bool:
    """Whether ``kernels``' attention for arrays of ``dtype`` takes the document ids itself and
    skips the tiles with no same-document pair (the Numba kernels and the GPU's float32/float64
    kernels: one call per block); else :func:`attend_fwd` calls the kernel once per document's
    block (numpy_ref's masked form is dense; the GPU's bf16 kernels take no documents). The
    kernel's ``block_sparse_documents`` is a bool, or a function of the dtype where one op
    routes dtypes to different kernels (`kernels.gpu_bf16.by_dtype`)."""
    flag = getattr(kernels.attention_fwd, "block_sparse_documents", False)
    return bool(flag(dtype) if callable(flag) else flag)


def kernel_documents(docs: DocumentPositions, qs: int, sq: int, ks: int, sk: int,
                     kernel: Any = None, q: Array | None = None) -> dict[str, Any]:
    """The ``q_docs`` ``[B, Sq]`` and ``k_docs`` ``[B, Sk]`` keyword arguments of a document-
    masked kernel call for the query run at ``qs`` and the key run at ``ks``: each row's
    document index (``docs.docs``, of :func:`document_ids`: non-decreasing along the row, as
    the kernels require). A kernel that turns the ids into tables of its own (the GPU's:
    ``kernel.document_tables``, device arrays) also gets ``tables``, found once per microbatch
    and block for q's head width and dtype (every layer asks again)."""
    out = {"q_docs": docs.docs[:, qs:qs + sq], "k_docs": docs.docs[:, ks:ks + sk]}
    make = getattr(kernel, "document_tables", None)
    if make is not None and q is not None:
        out["tables"] = docs.remember(
            ("kernel_tables", qs, sq, ks, sk, q.shape[-1], str(q.dtype)),
            lambda: make(out["q_docs"], out["k_docs"], q.shape[-1], q.dtype))
    return out


def attend_fwd(kernels, q: Array, k: Array, v: Array, qs: int, ks: int, window: int,
               docs: DocumentPositions | None) -> tuple[Array, Array] | None:
    """Causal attention of the query run at ``qs`` over the key run at ``ks`` (q ``[B, Sq, hq,
    D]``, k/v ``[B, Sk, hkv, D]``) -> (out, lse) as ``kernels.attention_fwd``. With ``docs`` a
    query sees only keys of its own document: one kernel call that skips the tiles with no
    same-document pair (:func:`documents_in_kernel`), else one causal call per document's
    block; a block with no same-document pair is not computed (None)."""
    if docs is None:
        return kernels.attention_fwd(q, k, v, qs, ks, True, window=window)
    runs = shared_runs(docs, qs, q.shape[1], ks, k.shape[1], window)
    if not runs:
        return None
    if documents_in_kernel(kernels, q.dtype):
        return kernels.attention_fwd(q, k, v, qs, ks, True, window=window,
                                     **kernel_documents(docs, qs, q.shape[1], ks, k.shape[1],
                                                        kernels.attention_fwd, q))
    xp, out, lse = kernels.xp, None, None
    for b, q0, q1, k0, k1 in runs:
        o, l = kernels.attention_fwd(q[b:b + 1, q0 - qs:q1 - qs], k[b:b + 1, k0 - ks:k1 - ks],
                                     v[b:b + 1, k0 - ks:k1 - ks], q0, k0, True, window=window)
        if out is None:
            out = xp.zeros(q.shape, o.dtype)
            lse = xp.full((q.shape[0], q.shape[2], q.shape[1]), -np.inf, l.dtype)
        out[b:b + 1, q0 - qs:q1 - qs] = o
        lse[b:b + 1, :, q0 - qs:q1 - qs] = l
    return out, lse


def attend_bwd(kernels, q: Array, k: Array, v: Array, out: Array, lse: Array, dout: Array,
               qs: int, ks: int, window: int, docs: DocumentPositions | None,
               grad_dtype: Any = None) -> tuple[Array, Array, Array] | None:
    """Gradients (dq, dk, dv) of :func:`attend_fwd`'s block given the merged out and lse; None
    for a block with no same-document pair. ``grad_dtype``: the activations' dtype, from a
    caller that keeps the gradients as they are (one block, no sum over ring steps): a kernel
    that can writes them in it (`numpy_ref.grad_dtype_of`); without it, the kernels' float32."""
    kw = {"window": window} if grad_dtype is None else {"window": window, "grad_dtype": grad_dtype}
    if docs is None:
        return kernels.attention_bwd(q, k, v, out, lse, dout, qs, ks, True, **kw)
    runs = shared_runs(docs, qs, q.shape[1], ks, k.shape[1], window)
    if not runs:
        return None
    if documents_in_kernel(kernels, q.dtype):
        return kernels.attention_bwd(q, k, v, out, lse, dout, qs, ks, True, **kw,
                                     **kernel_documents(docs, qs, q.shape[1], ks, k.shape[1],
                                                        kernels.attention_bwd, q))
    xp, grads = kernels.xp, None
    for b, q0, q1, k0, k1 in runs:
        qsl, ksl = slice(q0 - qs, q1 - qs), slice(k0 - ks, k1 - ks)
        parts = kernels.attention_bwd(q[b:b + 1, qsl], k[b:b + 1, ksl], v[b:b + 1, ksl],
                                      out[b:b + 1, qsl], lse[b:b + 1, :, qsl],
                                      dout[b:b + 1, qsl], q0, k0, True, window=window)
        if grads is None:
            grads = (xp.zeros(q.shape, parts[0].dtype), xp.zeros(k.shape, parts[1].dtype),
                     xp.zeros(v.shape, parts[2].dtype))
        grads[0][b:b + 1, qsl] += parts[0]
        grads[1][b:b + 1, ksl] += parts[1]
        grads[2][b:b + 1, ksl] += parts[2]
    return grads
