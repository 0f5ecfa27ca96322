"""Reference kernels: clear, vectorised array math, forward and backward.

This module is the reference every other backend is tested against, and the fallback for ops a
backend does not implement. The code is array-module generic: the module is taken from the input
arrays (`numpy` or `cupy`), so the same functions run on CuPy arrays unchanged.

Conventions:
  * arrays keep their dtype (float32 or float64) unless a docstring says otherwise;
  * attention tensors are `[batch, seq, heads, head_dim]`; log-sum-exp tensors are
    `[batch, heads, seq]`, in float64 for float64 inputs and float32 otherwise;
  * a query row that sees no key has `lse = -inf` and output 0 (this happens for blocks of
    ring attention), and contributes nothing to any gradient.

Mixed precision (bfloat16 storage, float32 compute). Every op also takes bf16 arrays
(`ml_dtypes.bfloat16`, NumPy's or CuPy's: the same dtype) and then follows one recipe: the inputs
are upcast to float32 once (exact), the op's float32 formula runs, and only the outputs marked
bf16 below are rounded to bf16 (round to nearest even), once; everything else stays float32.
With f() the exact upcast and r() that rounding of a float32 value:

  op                   bf16 (rounded once)                        float32
  linear_fwd           y = r(f(x) @ f(w).T + f(b))
  linear_bwd           dx = r(f(dy) @ f(w))                       dw = f(dy)^T f(x), or added
                                                                  into a given float32 dw
  linear_bias_bwd                                                 db = sum of f(dy) over rows
  embedding_fwd        rows of w (copied, nothing to round)
  embedding_bwd                                                   dw (a float32 buffer) += f(dx)
  rmsnorm_fwd          y = r(f(x) * rstd * f(w))                  rstd = 1/sqrt(mean(f(x)^2)+eps)
  rmsnorm_bwd          dx = r(rmsnorm_bwd's formula)              dw
  add_rmsnorm_fwd      s = r(f(x) + f(r)); y = rmsnorm_fwd(s) of   rstd (of the rounded s)
                       the rounded s (what the backward sees)
  add_rmsnorm_bwd      dsum = r(dx + f(ds)), dx the float32       dw
                       rmsnorm gradient (one rounding, not two)
  rope_fwd, rope_bwd   y = r(f(x1) c - f(x2) s, f(x2) c + f(x1) s), c, s: the tables in float32
  swiglu_fwd           h = r(f(g) sigmoid(f(g)) f(u))
  swiglu_bwd           dgate, dup = r(swiglu_bwd's formulas)
  geglu_fwd            h = r(gelu_tanh(f(g)) f(u))
  geglu_bwd            dgate, dup = r(geglu_bwd's formulas)
  attention_fwd        out = r(softmax(scale f(q) f(k)^T) f(v))   lse
  attention_bwd                                                   dq, dk, dv (from f(q), f(k),
                                                                  f(v), f(out), lse, f(dout));
                                                                  rounded once when the caller
                                                                  asks (`grad_dtype_of`)
  attention_merge      out = r(wa f(out_a) + wb f(out_b))         lse
  cross_entropy_stats                                             m, s, t
  cross_entropy_bwd    dlogits = r((softmax - onehot) * dloss)

"The float32 formula" is this module's own float32 code: on bf16 inputs each op equals, bit for
bit, its float32 result on the upcast inputs with the marked outputs rounded (`mixed_precision`).
GEMMs always multiply float32 operands (NumPy has no BLAS for bf16; cuBLAS's gemmEx with
CUBLAS_COMPUTE_32F computes the same product in float32 and rounds once). The storage dtype is
that of the op's first array argument: the marked outputs are rounded only when it is bf16 (so
`attention_merge` of a float32 running `out_a` and a bf16 block stays float32). Statistics
(`stat_dtype`) are float32 for bf16 inputs.
"""

from __future__ import annotations

import functools
import math
import sys
from types import ModuleType
from typing import Any, Callable, Sequence

import numpy as np

from .rope_frequencies import rope_attention_factor, rope_inv_freq

Array = Any  # numpy.ndarray or cupy.ndarray


def array_module(*arrays: Array) -> ModuleType:
    """Return `cupy` if any argument is a CuPy array, else `numpy`."""
    for a in arrays:
        if type(a).__module__.startswith("cupy"):
            return sys.modules["cupy"]
    return np


def stat_dtype(dtype: Any) -> np.dtype:
    """dtype for softmax statistics (lse, max, sums): float64 for float64 input, else float32
    (float32 and bfloat16)."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def grad_dtype_of(dtype: Any, grad_dtype: Any = None) -> np.dtype:
    """The dtype `attention_bwd` returns dq, dk, dv in for inputs of ``dtype``: by default
    float64 for float64 inputs, else float32 (callers sum them over ring steps and
    microbatches); ``grad_dtype`` may ask for that default, or, over a float32 default, for
    bfloat16: a caller that keeps the gradients as they are (no sum) and would round them to its
    bf16 activations gets the same bits without the float32 copy (a kernel that can writes them
    so; the others round their float32 result once). ValueError names any other request."""
    natural = stat_dtype(dtype)
    if grad_dtype is None:
        return natural
    asked = np.dtype(grad_dtype)
    require(asked == natural or (natural == np.float32 and is_bf16(asked)),
            f"attention_bwd: grad_dtype={asked} must be "
            + ("float32 or bfloat16" if natural == np.float32 else f"{natural} for {natural} inputs"))
    return asked


def is_bf16(dtype: Any) -> bool:
    """Whether `dtype` is bfloat16 (`ml_dtypes.bfloat16`; ml_dtypes need not be importable to ask)."""
    dtype = np.dtype(dtype)
    return dtype.kind == "V" and dtype.name == "bfloat16"


_NOT_AN_ARRAY = np.dtype(np.float64)


def _bf16_array(a: Any) -> bool:
    """Whether `a` is an array (or scalar) of dtype bfloat16 (a scalar type such as
    ``np.float32``, whose ``dtype`` is a class attribute, is not)."""
    dtype = getattr(a, "dtype", _NOT_AN_ARRAY)
    return isinstance(dtype, np.dtype) and dtype.kind == "V" and dtype.name == "bfloat16"


def _any_bf16(values: Any) -> bool:
    """Whether any of `values` is a bfloat16 array (a loop: this runs before every kernel call)."""
    for a in values:
        if _bf16_array(a):
            return True
    return False


def upcast(a: Any) -> Any:
    """`a` in float32 if it is a bfloat16 array (exact), else `a` itself."""
    return a.astype(np.float32) if _bf16_array(a) else a


def mixed_precision(*rounded: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: the bf16 recipe of the module docstring around a float32/float64 kernel.

    Called with no bfloat16 argument, the kernel runs unchanged. Otherwise every bfloat16 array
    argument is upcast to float32, the kernel runs, and when the first array argument (the
    storage dtype) is bfloat16 the outputs at positions `rounded` (0 for a single output) are
    rounded to bfloat16, once; the others are returned as the kernel made them (float32).
    """
    def wrap(kernel: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(kernel)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not _any_bf16(args) and not (kwargs and _any_bf16(kwargs.values())):
                return kernel(*args, **kwargs)
            result = kernel(*map(upcast, args), **{k: upcast(v) for k, v in kwargs.items()})
            storage = next(a.dtype for a in (*args, *kwargs.values()) if hasattr(a, "dtype"))
            if not is_bf16(storage):
                return result
            if not isinstance(result, tuple):
                return result.astype(storage) if 0 in rounded else result
            return tuple(out.astype(storage) if i in rounded and out is not None else out
                         for i, out in enumerate(result))
        return run
    return wrap


def require(cond: bool, message: str) -> None:
    """Raise ValueError(message) unless cond holds."""
    if not cond:
        raise ValueError(message)


# ----------------------------------------------------------------------------------------------
# Linear
# ----------------------------------------------------------------------------------------------

@mixed_precision(0)
def linear_fwd(x: Array, w: Array, b: Array | None = None) -> Array:
    """y = x @ w.T (+ b).

    x: `[..., in]`, w: `[out, in]`, b: `[out]` or None -> y: `[..., out]`.
    bf16: y = r(f(x) @ f(w).T + f(b)), the float32 product (and bias) rounded once.
    """
    require(w.ndim == 2, f"linear_fwd: w must be 2-D [out, in], got shape {w.shape}")
    require(x.shape[-1] == w.shape[1],
           f"linear_fwd: x.shape[-1]={x.shape[-1]} must equal w.shape[1]={w.shape[1]}")
    check_bias(b, w, "linear_fwd")
    y = x @ w.T
    if b is not None:
        y += b
    return y


def check_bias(b: Array | None, w: Array, name: str) -> None:
    """Validate a linear layer's bias `[out]` (or None) against its weight `[out, in]`."""
    require(b is None or b.shape == (w.shape[0],),
            f"{name}: b must be [out] = ({w.shape[0]},), got shape {getattr(b, 'shape', None)}")


@mixed_precision()
def linear_bias_bwd(dy: Array) -> Array:
    """Gradient of the bias of y = x @ w.T + b: dy `[..., out]` summed over its leading dims ->
    db `[out]` (in dy's dtype; float32 for bf16 dy)."""
    return dy.reshape(-1, dy.shape[-1]).sum(axis=0)


@mixed_precision(0)
def linear_bwd(dy: Array, x: Array, w: Array | None, dw: Array | None = None) -> tuple[Array, Array]:
    """Gradients of y = x @ w.T.

    dy: `[..., out]`, x: `[..., in]`, w: `[out, in]` ->
    dx: `[..., in]` = dy @ w, dw: `[out, in]` = sum over leading dims of dy^T x.
    dw: given, an existing `[out, in]` buffer the weight gradient is added into (in place; it is
    the dw returned). w: None computes only the weight gradient (dx is None; dw must be given):
    the deferred half of a zero-bubble schedule (its other half is `linear_fwd(dy, w.T)`).
    bf16 dy, x, w: dx = r(f(dy) @ f(w)); dw = f(dy)^T f(x) in float32 (a given dw: float32).
    """
    wshape = check_linear_bwd(dy, x, w, dw)
    dx = None if w is None else dy @ w
    grad = dy.reshape(-1, wshape[0]).T @ x.reshape(-1, wshape[1])
    if dw is None:
        return dx, grad
    dw += grad
    return dx, dw


def check_linear_bwd(dy: Array, x: Array, w: Array | None, dw: Array | None) -> tuple[int, int]:
    """Validate `linear_bwd`'s arguments; returns the weight's shape (out, in)."""
    wshape = getattr(w if w is not None else dw, "shape", None)
    require(wshape is not None and len(wshape) == 2, "linear_bwd: needs w [out, in] or a dw buffer")
    require(dy.shape[:-1] == x.shape[:-1] and (dy.shape[-1], x.shape[-1]) == wshape,
            f"linear_bwd: shapes dy {dy.shape}, x {x.shape}, w {wshape} must be [..., out], [..., in], [out, in]")
    require(dw is None or dw.shape == wshape, f"linear_bwd: dw {getattr(dw, 'shape', None)} must be {wshape}")
    return wshape


# ----------------------------------------------------------------------------------------------
# Embedding (one vocabulary shard)
# ----------------------------------------------------------------------------------------------

def _rows_held(ids: Array, row_start: int, rows: int) -> tuple[Array, Array]:
    """(row of each id in a shard of `rows` rows starting at `row_start` (0 where not held),
    whether the shard holds it)."""
    xp = array_module(ids)
    local = ids.astype(np.int64) - row_start
    held = (local >= 0) & (local < rows)
    return xp.where(held, local, 0), held


def embedding_fwd(w: Array, ids: Array, row_start: int = 0) -> Array:
    """Rows of one vocabulary shard.

    w: `[V_shard, H]` holding ids `[row_start, row_start + V_shard)`, ids: `[...]` ->
    x `[..., H]`: `w[id - row_start]` for the ids the shard holds, zero rows for the others
    (another shard holds them; the shards' outputs sum to the full embedding). x has w's dtype
    (bf16 rows are copied: nothing is rounded).
    """
    require(w.ndim == 2, f"embedding_fwd: w must be 2-D [rows, hidden], got shape {w.shape}")
    local, held = _rows_held(ids, row_start, w.shape[0])
    x = w[local]
    x *= held[..., None]
    return x


def embedding_bwd(dw: Array, dx: Array, ids: Array, row_start: int = 0) -> Array:
    """Accumulate into `dw` `[V_shard, H]` (in place; returned) the gradient of `embedding_fwd`:
    each row of `dx` `[..., H]` is added to the row of its id, for the ids the shard holds.
    The rows are added in dw's dtype: a float32 dw with bf16 dx adds f(dx)."""
    require(dx.shape == ids.shape + (dw.shape[1],),
            f"embedding_bwd: dx {dx.shape} must be ids {ids.shape} + [hidden={dw.shape[1]}]")
    local, held = _rows_held(ids.reshape(-1), row_start, dw.shape[0])
    xp = array_module(dw)
    xp.add.at(dw, local[held], dx.reshape(-1, dw.shape[1])[held].astype(dw.dtype, copy=False))
    return dw


# ----------------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------------

@mixed_precision(0)
def rmsnorm_fwd(x: Array, w: Array, eps: float) -> tuple[Array, Array]:
    """y = x / sqrt(mean(x**2) + eps) * w over the last axis.

    x: `[..., H]`, w: `[H]` -> y: `[..., H]`, rstd: `[...]` (1 / rms, kept for the backward).
    bf16: rstd = 1 / sqrt(mean(f(x)**2) + eps) in float32 (returned float32), y = r(f(x) * rstd * f(w)).
    """
    require(w.ndim == 1 and x.shape[-1] == w.shape[0],
           f"rmsnorm_fwd: w.shape={w.shape} must be [H] with H = x.shape[-1] = {x.shape[-1]}")
    require(eps >= 0, f"rmsnorm_fwd: eps={eps} must be >= 0")
    xp = array_module(x)
    rstd = (1.0 / xp.sqrt(xp.mean(x * x, axis=-1) + eps)).astype(x.dtype, copy=False)
    y = x * rstd[..., None] * w
    return y, rstd


@mixed_precision(0)
def rmsnorm_bwd(dy: Array, x: Array, w: Array, rstd: Array) -> tuple[Array, Array]:
    """Gradients of `rmsnorm_fwd`.

    dy, x: `[..., H]`, w: `[H]`, rstd: `[...]` -> dx: `[..., H]`, dw: `[H]` (summed over leading dims).
    dx = rstd * (dy*w) - rstd**3 * x * mean(dy*w*x).
    bf16 dy, x, w (float32 rstd): dx = r(that formula in float32), dw float32.
    """
    require(dy.shape == x.shape and rstd.shape == x.shape[:-1] and w.shape == x.shape[-1:],
           f"rmsnorm_bwd: shapes dy {dy.shape}, x {x.shape}, w {w.shape}, rstd {rstd.shape} "
           "must be [..., H], [..., H], [H], [...]")
    xp = array_module(x)
    r = rstd[..., None]
    dyw = dy * w
    dot = xp.mean(dyw * x, axis=-1, keepdims=True)
    dx = r * dyw - (r * r * r) * x * dot
    dw = (dy * x * r).reshape(-1, x.shape[-1]).sum(axis=0)
    return dx, dw


def add_rmsnorm_fwd(x: Array, r: Array, w: Array, eps: float) -> tuple[Array, Array, Array]:
    """Residual add then RMSNorm: s = x + r, y = rmsnorm(s) * w.

    x, r: `[..., H]`, w: `[H]` -> s: `[..., H]` (the new residual stream), y: `[..., H]`, rstd: `[...]`.
    bf16: s = r(f(x) + f(r)), then `rmsnorm_fwd` of that rounded s (the s the backward is given):
    the same bits as the add and the norm done apart.
    """
    require(x.shape == r.shape, f"add_rmsnorm_fwd: x.shape={x.shape} must equal r.shape={r.shape}")
    s = (upcast(x) + upcast(r)).astype(x.dtype, copy=False)
    y, rstd = rmsnorm_fwd(s, w, eps)
    return s, y, rstd


@mixed_precision(0)
def add_rmsnorm_bwd(dy: Array, ds: Array, s: Array, w: Array, rstd: Array) -> tuple[Array, Array]:
    """Gradients of `add_rmsnorm_fwd` given dy on y and ds on s (the gradient the residual stream
    brings from later layers).

    dy, ds, s: `[..., H]`, w: `[H]`, rstd: `[...]` -> dsum: `[..., H]` = rmsnorm_bwd(dy) + ds, the
    gradient of both x and r; dw: `[H]`.
    bf16: dsum = r(dx + f(ds)) with dx rmsnorm_bwd's float32 dx (rounded once, not twice); dw float32.
    """
    require(ds.shape == s.shape, f"add_rmsnorm_bwd: ds.shape={ds.shape} must equal s.shape={s.shape}")
    dx, dw = rmsnorm_bwd(dy, s, w, rstd)
    return dx + ds, dw


# ----------------------------------------------------------------------------------------------
# Rotary position embedding (rotate-half convention of Hugging Face Llama)
# ----------------------------------------------------------------------------------------------

def rope_cos_sin(positions: Array, head_dim: int, theta: float, dtype: Any,
                 scaling: str = "default", factor: float = 1.0, low_freq_factor: float = 1.0,
                 high_freq_factor: float = 4.0, original_max_positions: int = 0,
                 seq_len: int = 0, beta_fast: float = 32.0, beta_slow: float = 1.0,
                 mscale: float = 0.0, mscale_all_dim: float = 0.0) -> tuple[Array, Array]:
    """cos and sin tables for the given global token positions.

    positions: int `[S]` -> cos, sin: `[S, head_dim // 2]` in `dtype` (float32 for bf16
    activations: the rope kernels compute in float32 and read the tables as they are). The angles
    ``positions[s] * inv_freq[i]`` (:func:`rope_frequencies.rope_inv_freq` under ``scaling`` and
    its parameters) and their cos and sin times the rule's
    :func:`rope_frequencies.rope_attention_factor` are computed in float64 and then cast.
    ``seq_len``: the length of the whole sequence the positions belong to (dynamic scaling
    depends on it; 0 means ``max(positions) + 1``).
    """
    xp = array_module(positions)
    pos = xp.asarray(positions)
    require(pos.ndim == 1, f"rope_cos_sin: positions must be 1-D [S], got shape {pos.shape}")
    require(pos.dtype.kind in "iu", f"rope_cos_sin: positions dtype {pos.dtype} must be an integer type")
    if not seq_len and pos.size:
        seq_len = int(pos.max()) + 1
    inv_freq = xp.asarray(rope_inv_freq(head_dim, theta, scaling, factor, low_freq_factor,
                                        high_freq_factor, original_max_positions, seq_len,
                                        beta_fast, beta_slow))
    angles = pos.astype(np.float64)[:, None] * inv_freq[None, :]
    gain = rope_attention_factor(scaling, factor, mscale, mscale_all_dim)
    if gain == 1.0:
        return xp.cos(angles).astype(dtype), xp.sin(angles).astype(dtype)
    return (xp.cos(angles) * gain).astype(dtype), (xp.sin(angles) * gain).astype(dtype)


def check_rope_shapes(x: Array, cos: Array, sin: Array, name: str) -> None:
    """Validate x `[B, S, H, D]` (D even) against cos, sin `[S, D // 2]`."""
    require(x.ndim == 4, f"{name}: x must be [batch, seq, heads, head_dim], got shape {x.shape}")
    require(x.shape[3] % 2 == 0, f"{name}: head_dim={x.shape[3]} must be even")
    want = (x.shape[1], x.shape[3] // 2)
    require(cos.shape == want and sin.shape == want,
           f"{name}: cos {cos.shape} and sin {sin.shape} must be [seq, head_dim // 2] = {want}")


@mixed_precision(0)
def rope_fwd(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate pairs (x[..., i], x[..., i + D/2]) by the angle of each position.

    x: `[batch, seq, heads, head_dim]`, cos, sin: `[seq, head_dim // 2]` -> y like x:
    y1 = x1*cos - x2*sin, y2 = x2*cos + x1*sin (cos, sin cast to x's compute dtype).
    bf16 x: y = r(those in float32).
    """
    check_rope_shapes(x, cos, sin, "rope_fwd")
    xp = array_module(x)
    half = x.shape[3] // 2
    c = cos.astype(x.dtype, copy=False)[None, :, None, :]
    s = sin.astype(x.dtype, copy=False)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return xp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


@mixed_precision(0)
def rope_bwd(dy: Array, cos: Array, sin: Array) -> Array:
    """Gradient of `rope_fwd`: the inverse rotation. dy: `[batch, seq, heads, head_dim]` -> dx like dy
    (bf16 dy: dx = r(the rotation in float32))."""
    check_rope_shapes(dy, cos, sin, "rope_bwd")
    xp = array_module(dy)
    half = dy.shape[3] // 2
    c = cos.astype(dy.dtype, copy=False)[None, :, None, :]
    s = sin.astype(dy.dtype, copy=False)[None, :, None, :]
    d1, d2 = dy[..., :half], dy[..., half:]
    return xp.concatenate([d1 * c + d2 * s, d2 * c - d1 * s], axis=-1)


# ----------------------------------------------------------------------------------------------
# SwiGLU
# ----------------------------------------------------------------------------------------------

def sigmoid(g: Array) -> Array:
    """Overflow-free logistic function: exp is only taken of -|g|."""
    xp = array_module(g)
    e = xp.exp(-xp.abs(g))
    return xp.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(g.dtype, copy=False)


# ------------------------------------------------------------------------------------- moves
def split_columns(y: Array, widths: Sequence[int]) -> list[Array]:
    """The consecutive column blocks of ``y [..., sum(widths)]`` as contiguous arrays
    ``[..., w]`` (a stacked linear's output cut into one output per weight). Moves only: every
    backend's pieces are the same bits."""
    require(sum(widths) == y.shape[-1] and all(w >= 0 for w in widths),
            f"split_columns: widths {list(widths)} must be >= 0 and sum to y.shape[-1] = "
            f"{y.shape[-1]}")
    xp, at, out = array_module(y), 0, []
    for w in widths:
        out.append(xp.ascontiguousarray(y[..., at:at + w]))
        at += w
    return out


def concat(arrays: Sequence[Array], axis: int = -1) -> Array:
    """``arrays`` joined along ``axis`` (their other dimensions equal), a new contiguous array:
    stacked weights (axis 0) and the gradients of a stacked linear's outputs (axis -1). Moves
    only: the same bits on every backend."""
    require(len(arrays) > 0, "concat: needs at least one array")
    return array_module(*arrays).concatenate(list(arrays), axis=axis)


@mixed_precision(0)
def swiglu_fwd(gate: Array, up: Array) -> Array:
    """h = silu(gate) * up with silu(g) = g * sigmoid(g). gate, up: `[..., ffn]` -> h: `[..., ffn]`.

    bf16: h = r(f(g) * sigmoid(f(g)) * f(u)), all in float32.
    """
    require(gate.shape == up.shape, f"swiglu_fwd: gate.shape={gate.shape} must equal up.shape={up.shape}")
    return gate * sigmoid(gate) * up


@mixed_precision(0, 1)
def swiglu_bwd(dh: Array, gate: Array, up: Array) -> tuple[Array, Array]:
    """Gradients of `swiglu_fwd`. dh, gate, up: `[..., ffn]` -> (dgate, dup).

    d silu / dg = sig * (1 + g * (1 - sig)). bf16: dgate, dup = r(those in float32).
    """
    require(dh.shape == gate.shape == up.shape,
           f"swiglu_bwd: shapes dh {dh.shape}, gate {gate.shape}, up {up.shape} must be equal")
    sig = sigmoid(gate)
    silu = gate * sig
    dgate = dh * up * sig * (1.0 + gate * (1.0 - sig))
    dup = dh * silu
    return dgate, dup


GELU_TANH_C, GELU_TANH_K = math.sqrt(2.0 / math.pi), 0.044715  # gelu(g) = g/2 (1 + tanh(C (g + K g^3)))


@mixed_precision(0)
def geglu_fwd(gate: Array, up: Array) -> Array:
    """h = gelu_tanh(gate) * up (PyTorch's approximate="tanh", Gemma's gelu_pytorch_tanh).
    gate, up: `[..., ffn]` -> h. bf16: h = r(gelu_tanh(f(g)) f(u)), all in float32."""
    require(gate.shape == up.shape, f"geglu_fwd: gate.shape={gate.shape} must equal up.shape={up.shape}")
    t = array_module(gate).tanh(GELU_TANH_C * (gate + GELU_TANH_K * gate * gate * gate))
    return 0.5 * gate * (1.0 + t) * up


@mixed_precision(0, 1)
def geglu_bwd(dh: Array, gate: Array, up: Array) -> tuple[Array, Array]:
    """(dgate, dup) of `geglu_fwd`; with t = tanh(C (g + K g^3)), d gelu / dg =
    (1 + t)/2 + g/2 (1 - t^2) C (1 + 3 K g^2). bf16: r(those in float32)."""
    require(dh.shape == gate.shape == up.shape,
            f"geglu_bwd: shapes dh {dh.shape}, gate {gate.shape}, up {up.shape} must be equal")
    g2 = gate * gate
    t = array_module(gate).tanh(GELU_TANH_C * (gate + GELU_TANH_K * g2 * gate))
    slope = 0.5 * (1.0 + t) + 0.5 * gate * (1.0 - t * t) * GELU_TANH_C * (1.0 + 3.0 * GELU_TANH_K * g2)
    return dh * up * slope, dh * (0.5 * gate * (1.0 + t))


# ----------------------------------------------------------------------------------------------
# Attention (grouped-query, causal with global offsets, log-sum-exp for merging)
# ----------------------------------------------------------------------------------------------

def check_attention_shapes(q: Array, k: Array, v: Array, name: str) -> None:
    """Validate q `[B, Sq, Hq, D]`, k, v `[B, Sk, Hkv, D]` with Hq % Hkv == 0."""
    require(q.ndim == 4 and k.ndim == 4 and v.ndim == 4,
           f"{name}: q, k, v must be 4-D [batch, seq, heads, head_dim], got {q.shape}, {k.shape}, {v.shape}")
    require(k.shape == v.shape, f"{name}: k.shape={k.shape} must equal v.shape={v.shape}")
    require(q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3],
           f"{name}: batch and head_dim of q {q.shape} and k {k.shape} must agree")
    require(k.shape[2] > 0 and q.shape[2] % k.shape[2] == 0,
           f"{name}: query heads {q.shape[2]} must be a multiple of kv heads {k.shape[2]}")


def attention_scale(head_dim: int, scale: float | None) -> float:
    """The softmax scale: `scale` if given, else 1 / sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def visible_mask(xp: ModuleType, sq: int, sk: int, q_offset: int, k_offset: int,
                 window: int = 0) -> Array:
    """Boolean `[Sq, Sk]`: key j is visible to query i iff k_offset + j <= q_offset + i and, with a
    sliding `window` W > 0, also q_offset + i - (k_offset + j) < W (the query and the W - 1 keys
    before it, as Mistral's sliding_window)."""
    qpos = xp.arange(sq)[:, None] + q_offset
    kpos = xp.arange(sk)[None, :] + k_offset
    if window > 0:
        return (kpos <= qpos) & (qpos - kpos < window)
    return kpos <= qpos


def document_mask(q_docs: Array, k_docs: Array) -> Array:
    """Boolean `[B, 1, 1, Sq, Sk]` (broadcast over kv heads and their query heads): key j is in
    query i's document, from document ids q_docs `[B, Sq]` and k_docs `[B, Sk]`."""
    xp = array_module(q_docs)
    qd, kd = xp.asarray(q_docs), xp.asarray(k_docs)
    return (qd[:, :, None] == kd[:, None, :])[:, None, None]


def check_window(window: int, causal: bool, name: str) -> None:
    """A sliding window is a non-negative key count (0: none) and needs causal attention."""
    require(int(window) == window and window >= 0, f"{name}: window={window} must be an integer >= 0")
    require(causal or window == 0, f"{name}: window={window} needs causal=True")


def _grouped_scores(q: Array, k: Array, scale: float) -> Array:
    """scale * q.k for every query head: `[B, Hkv, G, Sq, Sk]` (G = Hq / Hkv query heads per kv head)."""
    xp = array_module(q)
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, sq, hkv, hq // hkv, d).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, Sq, D]
    kt = k.transpose(0, 2, 3, 1)[:, :, None]  # [B, Hkv, 1, D, Sk]
    return xp.matmul(qg, kt) * q.dtype.type(scale)


@mixed_precision(0)
def attention_fwd(q: Array, k: Array, v: Array, q_offset: int = 0, k_offset: int = 0,
                  causal: bool = True, scale: float | None = None,
                  window: int = 0, q_docs: Array | None = None,
                  k_docs: Array | None = None) -> tuple[Array, Array]:
    """Softmax attention of one block of queries over one block of keys.

    q: `[B, Sq, Hq, D]`, k, v: `[B, Sk, Hkv, D]`; query head h reads kv head h // (Hq // Hkv).
    Query i sits at global position q_offset + i, key j at k_offset + j; with `causal` key j is
    visible iff k_offset + j <= q_offset + i, and with a sliding `window` W > 0 only if also
    q_offset + i - (k_offset + j) < W (see `visible_mask`). Packed documents: with `q_docs`
    `[B, Sq]` and `k_docs` `[B, Sk]` (document ids) a key is visible only to queries of its own
    document (`document_mask`).
    Returns out `[B, Sq, Hq, D]` (q's dtype) and lse `[B, Hq, Sq]` = log sum_j exp(scale q.k_j) over
    visible keys (float64 for float64 q, else float32); rows with no visible key: out 0, lse -inf.
    bf16 q, k, v: scores, softmax and P V in float32, out = r(that float32 result), lse float32.
    """
    check_attention_shapes(q, k, v, "attention_fwd")
    check_window(window, causal, "attention_fwd")
    xp = array_module(q)
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    s = _grouped_scores(q, k, attention_scale(d, scale))  # [B, Hkv, G, Sq, Sk]
    if causal:
        s = xp.where(visible_mask(xp, sq, sk, q_offset, k_offset, window), s, -np.inf)
    if q_docs is not None:
        s = xp.where(document_mask(q_docs, k_docs), s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if sk > 0 else xp.full(s.shape[:-1] + (1,), -np.inf, q.dtype)
    m_safe = xp.where(xp.isfinite(m), m, 0.0).astype(q.dtype, copy=False)
    p = xp.exp(s - m_safe)  # masked entries: exp(-inf) = 0
    denom = p.sum(axis=-1, keepdims=True)
    seen = denom > 0
    out = xp.matmul(p, v.transpose(0, 2, 1, 3)[:, :, None]) / xp.where(seen, denom, 1.0)  # [B,Hkv,G,Sq,D]
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, sq, hq, d).astype(q.dtype, copy=False)
    lse_dtype = stat_dtype(q.dtype)
    lse = xp.where(seen, m_safe.astype(lse_dtype) + xp.log(xp.where(seen, denom, 1.0).astype(lse_dtype)),
                   -np.inf)
    return out, lse[..., 0].reshape(b, hq, sq)


@mixed_precision()
def attention_bwd(q: Array, k: Array, v: Array, out: Array, lse: Array, dout: Array,
                  q_offset: int = 0, k_offset: int = 0, causal: bool = True,
                  scale: float | None = None, window: int = 0, q_docs: Array | None = None,
                  k_docs: Array | None = None, grad_dtype: Any = None) -> tuple[Array, Array, Array]:
    """Gradients of `attention_fwd` for one key block, given the (possibly merged) out and lse
    (with the same causal mask, sliding `window` and documents).

    q, out, dout: `[B, Sq, Hq, D]`, k, v: `[B, Sk, Hkv, D]`, lse: `[B, Hq, Sq]`.
    `out`/`lse` may be the results merged over all key blocks (ring attention); then the sum over
    blocks of these gradients is the gradient of the merged attention. Flash-attention form:
    P = exp(scale QK^T - lse), delta = rowsum(dout*out), dV = P^T dout, dS = P (dout V^T - delta),
    dQ = scale dS K, dK = scale dS^T Q; dk, dv are summed over the query heads of each kv group.
    Returns dq `[B, Sq, Hq, D]`, dk, dv `[B, Sk, Hkv, D]`.
    bf16 q, k, v, out, dout (float32 lse): everything in float32 from their upcasts; dq, dk, dv
    float32 (the callers sum them over ring steps and microbatches), or bf16, rounded once, when
    ``grad_dtype`` asks (`grad_dtype_of`).
    """
    grads = grad_dtype_of(q.dtype, grad_dtype)
    check_attention_shapes(q, k, v, "attention_bwd")
    check_window(window, causal, "attention_bwd")
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    require(out.shape == q.shape and dout.shape == q.shape and lse.shape == (b, hq, sq),
           f"attention_bwd: out {out.shape}, dout {dout.shape} must be {q.shape} and lse {lse.shape} "
           f"must be {(b, hq, sq)}")
    xp = array_module(q)
    sc = attention_scale(d, scale)
    s = _grouped_scores(q, k, sc)  # [B, Hkv, G, Sq, Sk]
    lse_g = lse.reshape(b, hkv, g, sq, 1)
    lse_safe = xp.where(xp.isfinite(lse_g), lse_g, np.inf).astype(q.dtype, copy=False)
    p = xp.exp(s - lse_safe)  # rows with lse = -inf: exp(-inf) = 0
    if causal:
        p = xp.where(visible_mask(xp, sq, sk, q_offset, k_offset, window), p, 0.0).astype(q.dtype,
                                                                                      copy=False)
    if q_docs is not None:
        p = xp.where(document_mask(q_docs, k_docs), p, 0.0).astype(q.dtype, copy=False)
    dog = dout.reshape(b, sq, hkv, g, d).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, Sq, D]
    qg = q.reshape(b, sq, hkv, g, d).transpose(0, 2, 3, 1, 4)
    delta = (dout * out).sum(axis=-1).reshape(b, sq, hkv, g).transpose(0, 2, 3, 1)[..., None]
    v_t = v.transpose(0, 2, 3, 1)[:, :, None]  # [B, Hkv, 1, D, Sk]
    k_h = k.transpose(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, Sk, D]
    dp = xp.matmul(dog, v_t)  # [B, Hkv, G, Sq, Sk]
    ds = p * (dp - delta)
    pt = p.swapaxes(-1, -2)
    dv = xp.matmul(pt, dog).sum(axis=2)  # [B, Hkv, Sk, D]
    dk = (xp.matmul(ds.swapaxes(-1, -2), qg).sum(axis=2)) * q.dtype.type(sc)
    dq = xp.matmul(ds, k_h) * q.dtype.type(sc)  # [B, Hkv, G, Sq, D]
    dq = dq.transpose(0, 3, 1, 2, 4).reshape(b, sq, hq, d)
    return tuple(g.astype(grads, order="C", copy=False)
                 for g in (dq, dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)))


@mixed_precision(0)
def attention_merge(out_a: Array, lse_a: Array, out_b: Array, lse_b: Array) -> tuple[Array, Array]:
    """Combine two partial attentions over disjoint key sets by log-sum-exp.

    out_a, out_b: `[B, S, H, D]`, lse_a, lse_b: `[B, H, S]` -> (out, lse) of the same shapes.
    A side with lse = -inf (no visible key) has weight 0; if both are -inf the result is out 0, lse -inf.
    bf16: merged in float32, out = r(wa f(out_a) + wb f(out_b)) when out_a is bf16 (a float32
    out_a, a running sum kept in float32, gives a float32 out); lse float32.
    """
    require(out_a.shape == out_b.shape and lse_a.shape == lse_b.shape
           and lse_a.shape == (out_a.shape[0], out_a.shape[2], out_a.shape[1]),
           f"attention_merge: out shapes {out_a.shape}, {out_b.shape} must be equal [B, S, H, D] and lse shapes "
           f"{lse_a.shape}, {lse_b.shape} must be [B, H, S]")
    xp = array_module(out_a)
    lse = xp.maximum(lse_a, lse_b)
    finite = xp.isfinite(lse)
    base = xp.where(finite, lse, 0.0)
    wa = xp.where(xp.isfinite(lse_a), xp.exp(lse_a - base), 0.0)
    wb = xp.where(xp.isfinite(lse_b), xp.exp(lse_b - base), 0.0)
    total = wa + wb
    lse = xp.where(finite, base + xp.log(xp.where(finite, total, 1.0)), -np.inf).astype(lse_a.dtype, copy=False)
    inv = xp.where(finite, 1.0 / xp.where(finite, total, 1.0), 0.0)
    wa = (wa * inv).transpose(0, 2, 1)[..., None].astype(out_a.dtype, copy=False)
    wb = (wb * inv).transpose(0, 2, 1)[..., None].astype(out_a.dtype, copy=False)
    return wa * out_a + wb * out_b, lse


# ----------------------------------------------------------------------------------------------
# Cross-entropy (vocab-parallel statistics)
# ----------------------------------------------------------------------------------------------

def valid_columns(n_columns: int, vocab_start: int, vocab_size: int | None) -> int:
    """How many leading columns of a shard holding ids [vocab_start, vocab_start + n_columns) are real ids."""
    require(vocab_start >= 0, f"vocab_start={vocab_start} must be >= 0")
    if vocab_size is None:
        return n_columns
    require(vocab_size > 0, f"vocab_size={vocab_size} must be > 0")
    return max(0, min(n_columns, vocab_size - vocab_start))


def check_ce_inputs(logits: Array, targets: Array, vocab_size: int | None, name: str) -> None:
    """Validate logits `[N, Vloc]` and integer targets `[N]` with 0 <= target < vocab_size."""
    require(logits.ndim == 2, f"{name}: logits must be 2-D [tokens, vocab_shard], got shape {logits.shape}")
    require(targets.ndim == 1 and targets.shape[0] == logits.shape[0],
           f"{name}: targets shape {targets.shape} must be [tokens] = ({logits.shape[0]},)")
    require(targets.dtype.kind in "iu", f"{name}: targets dtype {targets.dtype} must be an integer type")
    if targets.size:
        xp = array_module(targets)
        lo, hi = int(xp.min(targets)), int(xp.max(targets))
        require(lo >= 0, f"{name}: target id {lo} must be >= 0")
        require(vocab_size is None or hi < vocab_size, f"{name}: target id {hi} must be < vocab_size={vocab_size}")


@mixed_precision()
def cross_entropy_stats(logits: Array, targets: Array, vocab_start: int = 0,
                        vocab_size: int | None = None) -> tuple[Array, Array, Array]:
    """Per-row softmax statistics of one vocab shard.

    logits: `[N, Vloc]` holding the columns of vocab ids [vocab_start, vocab_start + Vloc); targets: `[N]`
    global ids. Columns with id >= vocab_size are padding and ignored. Returns m `[N]` (local max, -inf
    if the shard is all padding), s `[N]` = sum exp(logits - m), t `[N]` = target logit if the target is
    in this shard else 0; float64 for float64 logits, else float32 (bf16 logits: from f(logits)).
    Combine shards with M = max m, S = sum s * exp(m - M), T = sum t: lse = M + log S, loss = lse - T.
    """
    check_ce_inputs(logits, targets, vocab_size, "cross_entropy_stats")
    xp = array_module(logits)
    n = logits.shape[0]
    nvalid = valid_columns(logits.shape[1], vocab_start, vocab_size)
    sd = stat_dtype(logits.dtype)
    if nvalid == 0:
        return xp.full(n, -np.inf, sd), xp.zeros(n, sd), xp.zeros(n, sd)
    lv = logits[:, :nvalid].astype(sd, copy=False)
    m = lv.max(axis=1)
    s = xp.exp(lv - m[:, None]).sum(axis=1)
    local = targets.astype(np.int64) - vocab_start
    inside = (local >= 0) & (local < nvalid)
    picked = lv[xp.arange(n), xp.where(inside, local, 0)]
    t = xp.where(inside, picked, 0.0).astype(sd, copy=False)
    return m, s, t


def cross_entropy_fwd(logits: Array, targets: Array, vocab_size: int | None = None) -> tuple[Array, Array]:
    """Cross-entropy of one unsharded set of logits: the composition of
    :func:`cross_entropy_stats` the model's vocabulary-parallel loss computes from its shards,
    kept as the reference the tests and ``bench kernels`` check against (not a dispatched op).

    logits: `[N, V]`, targets: `[N]` -> loss `[N]` = lse - target logit, lse `[N]` (statistics dtype:
    float32 for bf16 logits).
    Columns with id >= vocab_size are padding and ignored.
    """
    nvalid = valid_columns(logits.shape[1] if logits.ndim == 2 else 0, 0, vocab_size)
    require(nvalid > 0, f"cross_entropy_fwd: vocab_size={vocab_size} must leave at least one column")
    m, s, t = cross_entropy_stats(logits, targets, 0, nvalid)
    xp = array_module(logits)
    lse = m + xp.log(s)
    return lse - t, lse


@mixed_precision(0)
def cross_entropy_bwd(logits: Array, targets: Array, lse: Array, dloss: Array, vocab_start: int = 0,
                      vocab_size: int | None = None) -> Array:
    """Gradient of the per-row loss w.r.t. one vocab shard of logits.

    logits: `[N, Vloc]`, targets, lse, dloss: `[N]` (lse is the global one over all shards) ->
    dlogits `[N, Vloc]` (logits dtype) = (softmax - onehot(target in shard)) * dloss; padding columns 0.
    bf16 logits (float32 lse, dloss): dlogits = r(that in float32).
    """
    check_ce_inputs(logits, targets, vocab_size, "cross_entropy_bwd")
    n = logits.shape[0]
    require(lse.shape == (n,) and dloss.shape == (n,),
           f"cross_entropy_bwd: lse {lse.shape} and dloss {dloss.shape} must be [tokens] = ({n},)")
    xp = array_module(logits)
    sd = stat_dtype(logits.dtype)
    nvalid = valid_columns(logits.shape[1], vocab_start, vocab_size)
    grad = xp.zeros(logits.shape, sd)
    if nvalid > 0:
        p = xp.exp(logits[:, :nvalid].astype(sd, copy=False) - lse.astype(sd, copy=False)[:, None])
        local = targets.astype(np.int64) - vocab_start
        inside = (local >= 0) & (local < nvalid)
        rows = xp.arange(n)[inside]
        p[rows, local[inside]] -= 1.0
        grad[:, :nvalid] = p * dloss.astype(sd, copy=False)[:, None]
    return grad.astype(logits.dtype, copy=False)
