"""Packed documents through cuDNN's own variable-length attention (bf16): each document of a block
is one sequence of a ragged ("THD") batch, so cuDNN computes no pair across documents and no
tile of another document.

A block qualifies when its queries and keys are the same tokens (the diagonal block: every call
with one sequence per rank, Ulysses, a ring's own block), causal, with no sliding window, and the
rows' document ids are the same on both sides. Each row's runs of one id become sequences: their
lengths (``seq_len_q = seq_len_kv``) and their first elements' offsets into the packed arrays
(cuDNN's ragged offsets, one per tensor width, :data:`SIDE`: ``Hq * D`` for q, o, dq, ``Hkv * D``
for k, v, dk, dv, ``Hq`` for the statistics, which cuDNN keeps token-major, ``[B * S, Hq]``, so
the contract's ``[B, Hq, S]`` log-sum-exp is one transposition away). Every token belongs to
exactly one sequence, so out, lse, dq, dk, dv are written whole. The backward's workspace is
sized by the tokens (``max_total_seq_len``), not by sequences x the longest; every call declares
the block's tokens, which its offsets may reach anywhere in.

A graph is built per (sequences, longest, tokens, heads, head dim, scale). The sequence count and
the longest length are rounded up to powers of two (:func:`bucket`; the extra sequences have
length 0 and start at the end), so microbatches with different documents share a few graphs.

One call covers every sequence up to the longest one's length: a grid of sequences x the longest
(:func:`grid_tiles`, counted with 128-row tiles), of which a batch of short documents uses a
sixth (8 rows x 8192 tokens, 214 documents of median 200: 4096 tiles a head for 617 of the
documents' own). With :data:`GROUPED` the documents go in length classes instead, one call each
way per power-of-two class (:meth:`RaggedBatch.groups`: 992 tiles on that batch); every token
lies in exactly one class's sequences, so the calls together write each output whole.

Measured on an H100 (exact sizes, padded statistics; 8 x 8192 tokens, 214 documents of
median 200, 32 heads x 64): forward 0.97 ms, backward 2.78 ms, against flash_mma's document
kernels' 1.24 and 3.86 ms. In this form on an H200
(``tests/gpu/test_documents_gpu.py::test_cudnn_ragged_documents``), ``bench documents`` timed
the same batch's document-masked step through the seam at 3.67-3.69 ms with it against 4.83-4.94
ms through flash_mma (one row of 32 heads: 0.59-0.61 ms against 0.62-0.64, with one run
each way at 0.76-0.77), so :data:`ROUTED` is on. :func:`ragged_batch` and :func:`refusal` need
no CuPy and are tested on the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import cudnn_attention as ca
from . import numpy_ref as ref
from .cupy_arrays import host_array
from .numpy_ref import Array, require

ROUTED = True
"""Whether ``auto`` (`gpu_bf16.attention_ops`) sends a qualifying document block here instead of
to flash_mma (where cuDNN's frontend imports); see the module's note for the timing."""
GROUPED = False
"""Whether a block's documents go to cuDNN in power-of-two length classes, one call each way per
class (:meth:`RaggedBatch.groups`), rather than in one call whose grid runs every sequence to
the longest one's length. Off until a device times it (``jobs/gpu_check.sh``'s ``ragged``
stage: ``bench documents`` both ways)."""
MIN_SEQUENCES, MIN_LONGEST = 16, 64
"""The smallest buckets of :func:`bucket` (the sequence count, the longest sequence)."""
GRID_ROWS = 128
"""Query rows per tile in :func:`grid_tiles`' count (the bench's figure; not cuDNN's contract)."""
MAX_ELEMENTS = 2 ** 31 - 1
"""Ragged offsets are int32 elements: arrays of more elements go to flash_mma."""
SIDE = {"q": "q", "o": "q", "do": "q", "dq": "q", "k": "kv", "v": "kv", "dk": "kv", "dv": "kv",
        "stats": "stats"}
"""The ragged offsets (`RaggedBatch.device`: the query, key/value or statistics width) each
tensor of the graphs reads."""


def routed() -> bool:
    """Whether ``auto`` sends qualifying document blocks here now: :data:`ROUTED` and cuDNN's
    frontend imports."""
    return ROUTED and ca.frontend_unavailable() is None


def bucket(n: int, least: int) -> int:
    """The power of two >= max(``n``, ``least``)."""
    return 1 << (max(n, least) - 1).bit_length()


@dataclass(frozen=True, eq=False)
class RaggedBatch:
    """The sequences of one block's ``[B, S]`` document ids (host arrays): ``lengths`` int32
    ``[N]`` and ``starts`` int64 ``[N]`` (flat token ``b * S + p``), the real ``documents``
    first, then zero-length padding starting at ``B * S``; ``longest`` the bucketed Smax.
    Device copies are made once per head shape (:meth:`device`)."""

    rows: int
    seq: int
    documents: int
    longest: int
    lengths: np.ndarray
    starts: np.ndarray
    _device: dict = field(default_factory=dict, repr=False)
    _groups: list = field(default_factory=list, repr=False)

    @property
    def sequences(self) -> int:
        return int(self.lengths.size)

    def offsets(self, width: int) -> np.ndarray:
        """cuDNN's ragged offsets for a tensor of ``width`` elements a token: each sequence's
        first element, then the total, int32 ``[N + 1, 1, 1, 1]``."""
        flat = np.append(self.starts, self.rows * self.seq) * width
        return flat.astype(np.int32).reshape(-1, 1, 1, 1)

    def groups(self) -> tuple[RaggedBatch, ...]:
        """The documents by length class (``bucket(length, MIN_LONGEST)``), one batch a class,
        the longest class first; a class's sequence count is bucketed from 1 (the whole block's
        from :data:`MIN_SEQUENCES`). Made once."""
        if not self._groups:
            lengths, starts = self.lengths[:self.documents], self.starts[:self.documents]
            classes = np.array([bucket(int(n), MIN_LONGEST) for n in lengths], np.int64)
            for c in np.unique(classes)[::-1]:
                self._groups.append(_ragged_batch(self.rows, self.seq, starts[classes == c],
                                            lengths[classes == c], 1))
        return tuple(self._groups)

    def device(self, heads_q: int, heads_kv: int, head_dim: int) -> dict[str, Array]:
        """CuPy arrays of one head shape: ``seq`` (the lengths, ``[N, 1, 1, 1]`` int32) and each
        side's ragged offsets (:data:`SIDE`); made once."""
        key = (heads_q, heads_kv, head_dim)
        if key not in self._device:
            import cupy
            widths = {"q": heads_q * head_dim, "kv": heads_kv * head_dim, "stats": heads_q}
            self._device[key] = {"seq": cupy.asarray(self.lengths.reshape(-1, 1, 1, 1)),
                                 **{side: cupy.asarray(self.offsets(w))
                                    for side, w in widths.items()}}
        return self._device[key]


def ragged_batch(docs: Array) -> RaggedBatch:
    """The :class:`RaggedBatch` of document ids ``docs`` ``[B, S]`` (a new sequence wherever a
    row's id changes, and at each row's start). Pure."""
    docs = np.asarray(docs)
    require(docs.ndim == 2, f"ragged_batch: document ids must be [B, S], not {docs.shape}")
    b, s = docs.shape
    first = np.ones((b, s), bool)
    first[:, 1:] = docs[:, 1:] != docs[:, :-1]
    starts = np.flatnonzero(first.ravel())
    lengths = (np.append(starts[1:], b * s) - starts).astype(np.int32)
    return _ragged_batch(b, s, starts, lengths, MIN_SEQUENCES)


def _ragged_batch(rows: int, seq: int, starts: np.ndarray, lengths: np.ndarray,
            least: int) -> RaggedBatch:
    """The :class:`RaggedBatch` of the sequences (``starts``, ``lengths``) of a ``[rows, seq]``
    block: their count bucketed from ``least`` with zero-length sequences at the end."""
    pad = bucket(len(starts), least) - len(starts)
    return RaggedBatch(rows, seq, len(starts), bucket(int(lengths.max(initial=1)), MIN_LONGEST),
                        np.concatenate([lengths, np.zeros(pad, np.int32)]).astype(np.int32),
                        np.concatenate([starts, np.full(pad, rows * seq)]).astype(np.int64))


def calls(batch: RaggedBatch) -> tuple[RaggedBatch, ...]:
    """The batches cuDNN is called with for ``batch``, in order: its length classes where
    :data:`GROUPED`, else itself."""
    return batch.groups() if GROUPED else (batch,)


def grid_tiles(batches: tuple[RaggedBatch, ...]) -> int:
    """Query tiles of :data:`GRID_ROWS` rows a head that calls on ``batches`` launch when each
    runs every sequence to its longest length: the sum of sequences x ceil(longest / rows)."""
    return sum(lay.sequences * -(-lay.longest // GRID_ROWS) for lay in batches)


def document_tiles(batch: RaggedBatch) -> int:
    """Query tiles of :data:`GRID_ROWS` rows a head that ``batch``'s documents hold themselves
    (each document's length rounded up to whole tiles): what no grid can launch fewer of."""
    return int((-(-batch.lengths[:batch.documents] // GRID_ROWS)).sum())


def tile_entries(lengths: np.ndarray, rows: int, keys: int) -> int:
    """Score entries a causal kernel of ``rows`` x ``keys`` tiles computes on sequences of
    ``lengths`` (each from its own tile 0, as cuDNN's ragged calls and FlashAttention's varlen
    ones run documents), computing every tile it does not skip whole: query tile ``i`` of a
    sequence of ``n`` tokens walks the key tiles up to its last row's. With a sequence of the
    full row's length it is the full causal step's count; what a kernel of that tile shape
    computes per pair on these documents against the full causal step is the floor of its
    time / work at the full causal step's rate per entry."""
    total = 0
    for n in np.asarray(lengths, np.int64).ravel():
        last = np.minimum(np.arange(rows, n + rows, rows), n) - 1     # each query tile's last row
        total += rows * keys * int((last // keys + 1).sum())
    return total


def diagonal_batch(q_docs: Array, k_docs: Array) -> RaggedBatch | None:
    """The block's ragged batch when both sides hold the same ids (else None: not a diagonal block);
    the ids may be host or device arrays."""
    q, k = (a if isinstance(a, np.ndarray) else host_array(a) for a in (q_docs, k_docs))
    return ragged_batch(q) if q.shape == k.shape and np.array_equal(q, k) else None


def refusal(batch: RaggedBatch | None, q_shape: tuple[int, ...], k_shape: tuple[int, ...],
            q_offset: int, k_offset: int, causal: bool, window: int) -> str | None:
    """Why this call does not go to cuDNN's ragged attention (None: it does). Pure."""
    b, sq, hq, d = q_shape
    if batch is None or (batch.rows, batch.seq) != (b, sq):
        return "the queries' and keys' document ids differ (not a diagonal block)"
    if q_offset != k_offset or tuple(k_shape[:2]) != (b, sq):
        return "the keys are not the queries' own tokens"
    if not causal or window:
        return "only causal attention without a sliding window"
    if d % 8 or d > 128:
        return f"head dim {d}: cuDNN's ragged backward takes multiples of 8 up to 128"
    if b * sq * max(hq, k_shape[2]) * d > MAX_ELEMENTS:
        return f"{b * sq * max(hq, k_shape[2]) * d} elements: int32 ragged offsets"
    return None


# ----------------------------------------------------------------------------------------------
# Graphs and calls
# ----------------------------------------------------------------------------------------------

_GRAPHS: dict[tuple, tuple[Any, dict[str, Any], list, int]] = {}


def _define(cudnn: Any, kind: str, n: int, smax: int, tokens: int, hq: int, hkv: int, d: int,
            scale: float, handle: int) -> tuple[Any, dict[str, Any], list]:
    """The ragged sdpa ("fwd") or sdpa_backward ("bwd") graph of ``n`` sequences of up to
    ``smax`` of the ``tokens``: (graph, {name: graph tensor}, [(offsets tensor, side)])."""
    g = ca._new_graph(cudnn, handle, None)
    ints, bf16, f32 = cudnn.data_type.INT32, cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    offsets: list = []

    def dims(name: str) -> dict[str, Any]:
        if name == "stats":        # token-major, [B * S, Hq] like the tokens
            return {"dim": [n, hq, smax, 1], "stride": [hq * smax, 1, hq, 1]}
        h = hq if SIDE[name] == "q" else hkv
        return {"dim": [n, h, smax, d], "stride": [smax * h * d, d, h * d, 1]}

    def ragged(name: str, t: Any) -> Any:
        off = g.tensor(name=f"{name}_offsets", dim=[n + 1, 1, 1, 1], stride=[1, 1, 1, 1],
                       data_type=ints)
        t.set_ragged_offset(off)
        offsets.append((off, SIDE[name]))
        return t

    ins = ("q", "k", "v") if kind == "fwd" else ("q", "k", "v", "o", "do", "stats")
    t = {name: ragged(name, g.tensor(name=name, data_type=f32 if name == "stats" else bf16,
                                     **dims(name))) for name in ins}
    for name in ("seq_q", "seq_kv"):
        t[name] = g.tensor(name=name, dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=ints)
    kw = dict(use_padding_mask=True, seq_len_q=t["seq_q"], seq_len_kv=t["seq_kv"],
              diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0,
              attn_scale=scale)
    if kind == "fwd":
        t["o"], t["stats"] = g.sdpa(q=t["q"], k=t["k"], v=t["v"], generate_stats=True,
                                    name="ragged", **kw)
        outs: tuple[str, ...] = ("o", "stats")
    else:   # the workspace sized by the tokens there are, not by sequences x the longest
        t["dq"], t["dk"], t["dv"] = g.sdpa_backward(
            q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["do"], stats=t["stats"],
            name="ragged_backward", max_total_seq_len_q=tokens, max_total_seq_len_kv=tokens,
            **kw)
        outs = ("dq", "dk", "dv")
    for name in outs:
        shape = dims(name)
        t[name].set_output(True).set_data_type(f32 if name == "stats" else bf16) \
            .set_dim(shape["dim"]).set_stride(shape["stride"])
        ragged(name, t[name])
    return g, t, offsets


def _execute(kind: str, batch: RaggedBatch, hq: int, hkv: int, d: int, scale: float,
             buffers: dict[str, Array]) -> None:
    """Build (once per bucket) and run the ragged graph on CuPy ``buffers`` (by name)."""
    import cupy
    cudnn = ca._cudnn()
    handle = ca._handle(cudnn)
    n, smax, tokens = batch.sequences, batch.longest, batch.rows * batch.seq
    key = (cupy.cuda.Device().id, kind, n, smax, tokens, hq, hkv, d, scale)
    if key not in _GRAPHS:
        g, tensors, offsets = _define(cudnn, kind, n, smax, tokens, hq, hkv, d, scale, handle)
        try:
            g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        except Exception as exc:
            raise ca.CudnnRefused(f"cuDNN built no ragged {kind} plan for {n} sequences of up "
                                  f"to {smax} tokens: {exc}") from exc
        _GRAPHS[key] = (g, tensors, offsets, int(g.get_workspace_size()))
    g, tensors, offsets, workspace_bytes = _GRAPHS[key]
    dev = batch.device(hq, hkv, d)
    pack = {tensors[name]: int(a.data.ptr) for name, a in buffers.items()}
    pack[tensors["seq_q"]] = pack[tensors["seq_kv"]] = int(dev["seq"].data.ptr)
    pack.update({off: int(dev[side].data.ptr) for off, side in offsets})
    workspace = cupy.empty(max(workspace_bytes, 1), cupy.uint8)
    g.execute(pack, int(workspace.data.ptr), handle=handle)


def _contiguous(**arrays: Array) -> dict[str, Array]:
    import cupy
    ca._check_bf16("cudnn_documents", **arrays)
    return {name: cupy.ascontiguousarray(a) for name, a in arrays.items()}


def attention_fwd(q: Array, k: Array, v: Array, batch: RaggedBatch,
                  scale: float | None = None) -> tuple[Array, Array]:
    """Causal attention of each document of ``batch`` over itself: q `[B, S, Hq, D]`, k, v
    `[B, S, Hkv, D]` bf16 -> out bf16 `[B, S, Hq, D]`, lse float32 `[B, Hq, S]` (numpy_ref's
    contract with ``q_docs = k_docs``, equal offsets)."""
    import cupy
    a = _contiguous(q=q, k=k, v=v)
    b, s, hq, d = q.shape
    out = cupy.empty(q.shape, q.dtype)
    stats = cupy.empty((b, s, hq), cupy.float32)
    for part in calls(batch):
        _execute("fwd", part, hq, k.shape[2], d, ref.attention_scale(d, scale),
                 {**a, "o": out, "stats": stats})
    return out, cupy.ascontiguousarray(stats.transpose(0, 2, 1))


def attention_bwd(q: Array, k: Array, v: Array, out: Array, lse: Array, dout: Array,
                  batch: RaggedBatch, scale: float | None = None, grad_dtype: Any = None
                  ) -> tuple[Array, Array, Array]:
    """Gradients of :func:`attention_fwd` from the (merged) ``out`` and ``lse``: dq `[B, S, Hq,
    D]`, dk, dv `[B, S, Hkv, D]`, float32, or bf16 where ``grad_dtype`` asks (cuDNN's own)."""
    import cupy
    grads = ref.grad_dtype_of(q.dtype, grad_dtype)
    a = _contiguous(q=q, k=k, v=v, o=out, do=dout)
    d = q.shape[3]
    stats = cupy.ascontiguousarray(lse.transpose(0, 2, 1), dtype=cupy.float32)
    g = {"dq": cupy.empty(q.shape, q.dtype), "dk": cupy.empty(k.shape, q.dtype),
         "dv": cupy.empty(k.shape, q.dtype)}
    for part in calls(batch):
        _execute("bwd", part, q.shape[2], k.shape[2], d, ref.attention_scale(d, scale),
                 {**a, "stats": stats, **g})
    return tuple(g[n].astype(grads, copy=False) for n in ("dq", "dk", "dv"))
