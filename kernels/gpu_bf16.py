"""The cupy backend's bfloat16 ops: tensor-core GEMMs through cuBLAS, fused row and elementwise
kernels, and fused attention from cuDNN or mpipar's own kernel, behind numpy_ref's signatures
and its mixed-precision recipe (bf16 activations; float32 statistics, weight and attention
gradients).

- linear ops: cuBLAS ``gemmEx`` (:mod:`.cublas`): bf16 operands, float32 accumulation, bf16 out;
  the weight gradient accumulated straight into its float32 buffer (beta = 1);
- norms, RoPE, SwiGLU, the vocabulary-parallel cross-entropy, the embedding gradient:
  :mod:`.cuda_fused` (bf16 in, float32 math, vectorised loads); the stacked linears' column
  cuts and joins: :mod:`.cuda_moves`;
- attention: one of two backends with the same contract, chosen by :func:`attention_choice`:
  ``cudnn`` (cuDNN's fused attention through its frontend, :mod:`.cudnn_attention`) or
  ``mpipar`` (mpipar's FA2-style kernel, :mod:`.flash_mma`). ``auto`` takes cuDNN where it
  imports and takes the case, else mpipar's; a case cuDNN refuses at run time falls back to
  mpipar's kernel under ``auto`` and is an error under ``cudnn``. Packed documents go to
  mpipar's kernel (it takes the ids), or under ``auto`` with ``cudnn_documents.ROUTED`` a
  diagonal block to cuDNN's ragged attention (:mod:`.cudnn_documents`).

The dispatcher (:mod:`mpipar.kernels`) routes an op here when its first array is bf16 (the
embedding's gradient: its ``dx``, :data:`ROUTED_BY`) and to :mod:`.cupy_gpu` (float32, float64)
otherwise. Importing this module imports neither CuPy nor
cuDNN.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from . import numpy_ref as ref
from .numpy_ref import Array

ATTENTION_BACKENDS = ("auto", "cudnn", "mpipar")
FUSED_OPS = ("rmsnorm_fwd", "rmsnorm_bwd", "add_rmsnorm_fwd", "add_rmsnorm_bwd", "rope_fwd",
             "rope_bwd", "swiglu_fwd", "swiglu_bwd", "cross_entropy_stats",
             "cross_entropy_bwd", "embedding_bwd")
LINEAR_OPS = ("linear_fwd", "linear_bwd")
ATTENTION_OPS = ("attention_fwd", "attention_bwd")


# ------------------------------------------------------------------------------------ linear
def _rows(a: Array) -> Array:
    """``a`` as a 2-D ``[tokens, features]`` array (a view when it is contiguous)."""
    return a.reshape(-1, a.shape[-1])


def linear_fwd(x: Array, w: Array, b: Array | None = None) -> Array:
    """``x [..., in] @ w[out, in].T (+ b)``: one cuBLAS GEMM, float32 accumulation, bf16 out. A
    ``w`` that is the transpose of a contiguous ``W`` (an input gradient ``dy @ W`` asked as
    ``linear_fwd(dy, W.T)``) is read as it lies (cuBLAS's no-transpose case), not copied."""
    from . import cublas

    ref.check_bias(b, w, "linear_fwd")
    out_dtype = None if b is None else "float32"
    if not w.flags.c_contiguous and w.T.flags.c_contiguous:   # w = W.T (dx = dy @ W): no copy
        y = cublas.matmul(_rows(x), w.T, out_dtype=out_dtype)
    else:
        y = cublas.matmul(_rows(x), w, trans_b=True, out_dtype=out_dtype)
    if b is not None:  # the bias joins the float32 accumulation, then one rounding
        y = (y + b.astype(y.dtype)).astype(x.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


def linear_bwd(dy: Array, x: Array, w: Array | None, dw: Array | None = None
               ) -> tuple[Array | None, Array]:
    """``dx = dy @ w`` (bf16; None when ``w`` is None) and ``dw = dy^T x`` in float32, added into
    ``dw`` when given (beta = 1: the microbatches' weight gradients accumulate in the GEMM)."""
    import cupy

    from . import cublas

    dy2, x2 = _rows(dy), _rows(x)
    if dw is None:
        dw = cupy.zeros((dy2.shape[1], x2.shape[1]), cupy.float32)
        beta = 0.0
    else:
        beta = 1.0
    cublas.matmul(dy2, x2, trans_a=True, out=dw, beta=beta)
    dx = None if w is None else cublas.matmul(dy2, w).reshape(*dy.shape[:-1], w.shape[1])
    return dx, dw


# --------------------------------------------------------------------------------- attention
@dataclass(frozen=True)
class AttentionChoice:
    """The attention backend a run uses for bf16, and why (the run's first line prints it)."""

    backend: str     # "cudnn" or "mpipar"
    reason: str

    def describe(self) -> str:
        return f"attention: {self.backend} ({self.reason})"


def attention_choice(requested: str, head_dim: int, window: int = 0) -> AttentionChoice:
    """The backend for ``requested`` (auto, cudnn, mpipar) and a model of ``head_dim`` (causal,
    sliding ``window`` if any). ``cudnn`` that cannot run raises ValueError with cuDNN's reason;
    ``auto`` falls back to mpipar's kernel with that reason."""
    from . import cudnn_attention, flash_mma

    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {requested!r}: must be one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    bf16 = _bf16_dtype()
    mine = flash_mma.supports(bf16, head_dim)
    if requested == "mpipar":
        if mine is not None:
            raise ValueError(f"attention backend 'mpipar': {mine}")
        return AttentionChoice("mpipar", "asked for")
    theirs = cudnn_attention.supports(bf16, head_dim, causal=True, window=window)
    if theirs is None:
        return AttentionChoice("cudnn", "asked for" if requested == "cudnn"
                               else "cuDNN's frontend imports and takes the model's attention")
    if requested == "cudnn":
        raise ValueError(f"attention backend 'cudnn': {theirs}")
    if mine is not None:
        raise ValueError(f"no bf16 attention kernel for this model: cuDNN: {theirs}; "
                         f"mpipar: {mine}")
    return AttentionChoice("mpipar", f"cuDNN not used: {theirs}")


def documents_route(choice: AttentionChoice) -> str:
    """Where ``choice``'s bf16 calls with packed documents go (`attention_ops`), in words."""
    from . import cudnn_documents

    if choice.backend == "mpipar":
        return "mpipar's kernel"
    if choice.reason == "asked for":
        return "cuDNN, a call per document's block"
    if cudnn_documents.routed():
        return "cuDNN's ragged attention for diagonal blocks, mpipar's kernel for the others"
    return "mpipar's kernel"


def _bf16_dtype() -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16


PER_CALL = AttentionChoice("auto", "cuDNN for each call it takes, else mpipar's kernel")
"""The choice before a model is known: cuDNN where it takes the call's case, else mpipar's."""


def attention_ops(choice: AttentionChoice) -> tuple[Callable, Callable]:
    """(attention_fwd, attention_bwd) of ``choice``. A ``cudnn`` choice made by ``auto`` sends
    the cases cuDNN refuses (a mask it cannot express) to mpipar's kernel, as :data:`PER_CALL`
    does; one that was asked for raises cuDNN's refusal."""
    from . import cudnn_attention, cudnn_documents, flash_mma

    if choice.backend == "mpipar":
        return flash_mma.attention_fwd, flash_mma.attention_bwd
    if choice.reason == "asked for":
        return cudnn_attention.attention_fwd, cudnn_attention.attention_bwd

    def takes(q: Array, k: Array, q_offset: int, k_offset: int, causal: bool, window: int) -> bool:
        return cudnn_attention.supports(q.dtype, q.shape[-1], q_offset, k_offset, causal, window,
                                        q.shape[1], k.shape[1]) is None

    def ragged(q: Array, k: Array, q_offset: int, k_offset: int, causal: bool, window: int,
               documents: dict) -> Any:
        """The block's `cudnn_documents.RaggedBatch` where cuDNN's ragged attention takes it."""
        batch = (documents.get("tables") or {}).get("ragged")
        if batch is not None and cudnn_documents.refusal(batch, q.shape, k.shape, q_offset,
                                                         k_offset, causal, window) is None:
            return batch
        return None

    def fwd(q, k, v, q_offset=0, k_offset=0, causal=True, scale=None, window=0, **documents):
        if documents:   # packed documents: mpipar's kernel, or cuDNN's ragged one (`tables`)
            batch = ragged(q, k, q_offset, k_offset, causal, window, documents)
            if batch is not None:
                return cudnn_documents.attention_fwd(q, k, v, batch, scale)
            return flash_mma.attention_fwd(q, k, v, q_offset, k_offset, causal, scale, window,
                                           **documents)
        impl = cudnn_attention if takes(q, k, q_offset, k_offset, causal, window) else flash_mma
        return impl.attention_fwd(q, k, v, q_offset, k_offset, causal, scale, window)

    def bwd(q, k, v, out, lse, dout, q_offset=0, k_offset=0, causal=True, scale=None, window=0,
            grad_dtype=None, **documents):
        if documents:
            batch = ragged(q, k, q_offset, k_offset, causal, window, documents)
            if batch is not None:
                return cudnn_documents.attention_bwd(q, k, v, out, lse, dout, batch, scale,
                                                     grad_dtype)
            return flash_mma.attention_bwd(q, k, v, out, lse, dout, q_offset, k_offset, causal,
                                           scale, window, grad_dtype=grad_dtype, **documents)
        impl = cudnn_attention if takes(q, k, q_offset, k_offset, causal, window) else flash_mma
        return impl.attention_bwd(q, k, v, out, lse, dout, q_offset, k_offset, causal, scale,
                                  window, grad_dtype=grad_dtype)

    def tables(q_docs: Array, k_docs: Array, head_dim: int = 0, dtype: Any = None) -> dict:
        """flash_mma's tables, and where cuDNN's ragged attention is routed (`cudnn_documents.
        ROUTED`) the block's ragged batch ("ragged"; None off the diagonal)."""
        found = flash_mma.document_tables(q_docs, k_docs)
        if cudnn_documents.routed():
            found["ragged"] = cudnn_documents.diagonal_batch(q_docs, k_docs)
        return found

    for op in (fwd, bwd):
        op.block_sparse_documents = True
        op.document_tables = tables
    return fwd, bwd


# ---------------------------------------------------------------------------------- routing
ROUTED_BY = {"embedding_bwd": (1, "dx")}
"""Ops whose precision is not their first array's: (position, name) of the array that decides.
The embedding's gradient accumulates bf16 ``dx`` rows into a float32 ``dw``: routed by its
first array, a bf16 run's embedding gradient went through the float32 path's scatter-add
(a boolean mask, so a device synchronisation, and atomics) instead of the fused kernel; on an
H200 that was 0.1 s of a 0.37 s step of a 1.1B model."""


def by_dtype(float_op: Callable, bf16_op: Callable, position: int = 0,
             name: str | None = None) -> Callable:
    """One op that runs ``bf16_op`` when its deciding array (the argument at ``position``, or
    keyword ``name``; by default the first) is bf16, else ``float_op``."""

    @functools.wraps(float_op)
    def op(*args: Any, **kwargs: Any) -> Any:
        if len(args) > position:
            decides = args[position]
        elif name is not None and name in kwargs:
            decides = kwargs[name]
        else:
            decides = args[0] if args else next(iter(kwargs.values()))
        if isinstance(decides, (list, tuple)):      # concat: its first array decides
            decides = decides[0]
        return (bf16_op if ref.is_bf16(decides.dtype) else float_op)(*args, **kwargs)

    # Packed documents (`mpipar.model.attention.documents_in_kernel`): the float kernels take the
    # document ids, the bf16 ones (cuDNN when asked for) may not, so the answer depends on the
    # dtype routed; so do the tables each kernel makes of the ids (`document_tables`).
    pair = (float_op, bf16_op)
    takes = [bool(getattr(f, "block_sparse_documents", False)) for f in pair]
    if takes[0] != takes[1]:
        op.block_sparse_documents = lambda dtype: takes[bool(ref.is_bf16(dtype))]
    makers = [getattr(f, "document_tables", None) for f in pair]
    if all(makers) and makers[0] is not makers[1]:
        op.document_tables = lambda q_docs, k_docs, head_dim, dtype: makers[
            bool(ref.is_bf16(dtype))](q_docs, k_docs, head_dim, dtype)
    return op


def bf16_ops(choice: AttentionChoice) -> dict[str, Callable]:
    """Every bf16 op this module provides, by name (the dispatcher routes by dtype)."""
    from . import cuda_fused, cuda_moves

    ops: dict[str, Callable] = {op: getattr(cuda_fused, op) for op in FUSED_OPS}
    ops.update({op: getattr(cuda_moves, op) for op in cuda_moves.MOVE_OPS})
    ops.update(linear_fwd=linear_fwd, linear_bwd=linear_bwd)
    ops["attention_fwd"], ops["attention_bwd"] = attention_ops(choice)
    return ops
