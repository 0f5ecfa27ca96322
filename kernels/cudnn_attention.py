"""cuDNN's fused attention (bf16) behind numpy_ref's attention contract.

`attention_fwd` / `attention_bwd` take bf16 CuPy arrays (``ml_dtypes.bfloat16``) in the layout
``[B, S, H, D]`` and call cuDNN's ``sdpa`` / ``sdpa_backward`` through ``nvidia-cudnn-frontend``
(``import cudnn``; no PyTorch). The arrays reach cuDNN through their strides, as
``[B, H, S, D]`` tensors, so nothing is transposed. Grouped-query heads, the float32 log-sum-exp
(``[B, Hq, Sq]``, the ring merge's) and a backward from merged ``out``/``lse`` (``sdpa_backward``
takes O and the statistics as plain inputs) are cuDNN's own. cuDNN writes dq, dk, dv in bf16
(:data:`GRAD_DTYPE`); they are returned widened to float32, as the contract has them.

Masks: numpy_ref's rule (key j visible to query i iff ``k_offset + j <= q_offset + i``, and with a
window W also ``q_offset + i - (k_offset + j) < W``) is mapped by :func:`mask_plan` onto cuDNN's
diagonal band. First the query rows that see no key and the keys no row sees are cut off (views
of the arrays, no copies): those rows get out 0, lse -inf and dq 0, those keys dk = dv = 0,
without cuDNN; a block nobody sees never reaches cuDNN. In the block that is left the first row
sees a key, so the shifted diagonal ``d = q_offset + r0 - (k_offset + c0)`` is >= 0 and the mask
is a band ``j - i <= d`` (cuDNN's right bound, top-left aligned), ``i - j < W - d`` (left bound),
written in cuDNN's plainest form: no mask (an earlier key block wholly visible), top-left causal
(the diagonal block), bottom-right causal (``d = Sk' - Sq'``, the usual zigzag block) or a general
band. :func:`plan_visible` evaluates a plan with cuDNN's documented semantics, so the host tests
compare it with ``numpy_ref.visible_mask`` without a device.

Graphs are built once per (shapes, strides, mask, scale) and cached; one cuDNN handle per device,
bound to CuPy's current stream at every call; workspaces come from CuPy's allocator. Importing
this module imports neither cudnn nor CuPy (:func:`frontend_unavailable` says what is missing),
and :func:`supports` tells the backend choice which cases cuDNN takes.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from . import numpy_ref as ref
from .numpy_ref import Array, require

FRONTEND_REQUIREMENT = "nvidia-cudnn-frontend>=1.14,<1.24"
"""The lean frontend range (1.24+ hard-depends on a large DSL package; see shared/GPU.md)."""
MIN_BACKEND = 91002
"""cuDNN 9.10.2: the diagonal band with bottom-right alignment, left bounds without a right
bound, and past 9.10.0/9.10.1's known sdpa bugs (the frontend's own support table)."""
MAX_HEAD_DIM = 256
TOP_LEFT, BOTTOM_RIGHT = "top_left", "bottom_right"


class CudnnRefused(ValueError):
    """cuDNN cannot take this attention case; the message says why (callers fall back)."""


# ----------------------------------------------------------------------------------------------
# The frontend, imported on first use
# ----------------------------------------------------------------------------------------------

def _preload_library() -> None:
    """Load ``libcudnn.so.9`` from the ``nvidia-cudnn-cu*`` wheel wherever it is installed: the
    frontend looks only in the interpreter's purelib, then asks the loader for the soname, which
    then finds this already-loaded copy."""
    import ctypes
    import glob
    import os
    try:
        import nvidia.cudnn as wheel  # namespace package of nvidia-cudnn-cu12 / -cu13
    except Exception:
        return
    for root in getattr(wheel, "__path__", []):
        for path in sorted(glob.glob(os.path.join(root, "lib", "libcudnn.so.*[0-9]"))):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                return
            except OSError:
                continue


@functools.lru_cache(maxsize=1)
def _frontend() -> tuple[ModuleType | None, str | None]:
    """(the ``cudnn`` module, None) or (None, why it cannot be used)."""
    _preload_library()
    try:
        import cudnn
    except Exception as exc:  # ImportError, or RuntimeError when libcudnn is not found
        return None, (f"the cuDNN frontend is not usable ({type(exc).__name__}: {exc}); install "
                      f"'{FRONTEND_REQUIREMENT}' and nvidia-cudnn-cu12/-cu13")
    try:
        version = int(cudnn.backend_version())
    except Exception as exc:
        return None, f"the cuDNN library did not load ({type(exc).__name__}: {exc})"
    if version < MIN_BACKEND:
        return None, f"cuDNN {version} is older than {MIN_BACKEND} (9.10.2)"
    return cudnn, None


def frontend_unavailable() -> str | None:
    """None if ``import cudnn`` works with a recent enough cuDNN library, else why not."""
    return _frontend()[1]


def _cudnn() -> ModuleType:
    module, reason = _frontend()
    if module is None:
        raise CudnnRefused(reason)
    return module


def _bf16() -> np.dtype:
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


# ----------------------------------------------------------------------------------------------
# Masks: numpy_ref's offsets/causal/window as a cuDNN diagonal band over a trimmed block
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MaskPlan:
    """How one mask case reaches cuDNN: query rows ``[r0, r1)`` and keys ``[c0, c1)`` go to
    cuDNN with the band (``alignment``, ``right``, ``left``; None: no bound), the other rows get
    out 0 / lse -inf, the other keys no gradient. ``refused``: why cuDNN cannot take it."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    alignment: str = TOP_LEFT
    right: int | None = None
    left: int | None = None
    refused: str | None = None

    @property
    def empty(self) -> bool:
        """No query sees any key: nothing for cuDNN to do."""
        return self.rows[0] >= self.rows[1] or self.cols[0] >= self.cols[1]

    def covers(self, sq: int, sk: int) -> bool:
        """Whether cuDNN sees every row and every key of an ``sq`` x ``sk`` block."""
        return self.rows == (0, sq) and self.cols == (0, sk)


def _band(sq: int, sk: int, d: int, window: int) -> tuple[str, int | None, int | None]:
    """cuDNN's plainest band for a block whose row i sees keys ``(i + d - window, i + d]``
    (``window`` 0: unbounded below), ``d >= 0``: (alignment, right bound, left bound)."""
    left = window - d if window else None
    if d >= sk - 1:  # the right bound cuts no key
        return TOP_LEFT, None, (left if left is not None and left <= sq - 1 else None)
    if d == 0:
        return TOP_LEFT, 0, (window if window and window <= sq - 1 else None)
    if d == sk - sq:  # the diagonal ends in the bottom-right corner
        return BOTTOM_RIGHT, 0, (window if window and window <= sk - 1 else None)
    return TOP_LEFT, d, (left if left is not None and left <= sq - 1 else None)


def mask_plan(sq: int, sk: int, q_offset: int = 0, k_offset: int = 0, causal: bool = True,
              window: int = 0) -> MaskPlan:
    """Map numpy_ref's mask (queries at ``q_offset + i``, keys at ``k_offset + j``, ``causal``,
    sliding ``window``) for an ``sq`` x ``sk`` block onto a :class:`MaskPlan`. Pure: no cuDNN."""
    ref.check_window(window, causal, "cudnn mask_plan")
    if sq <= 0 or sk <= 0:
        return MaskPlan((0, 0), (0, 0))
    if not causal:
        return MaskPlan((0, sq), (0, sk), refused=_single_pair(sq, sk))
    d = q_offset - k_offset  # row i sees key j iff j - i <= d (and i - j < window - d)
    r0 = max(0, -d)
    r1 = min(sq, sk - 1 - d + window) if window else sq
    if r0 >= r1:
        return MaskPlan((0, 0), (0, 0))
    c0 = max(0, r0 + d - window + 1) if window else 0
    c1 = min(sk, r1 + d)
    sq2, sk2, d2 = r1 - r0, c1 - c0, d + r0 - c0
    alignment, right, left = _band(sq2, sk2, d2, window)
    refused = None
    if left is not None and sq2 > sk2:
        refused = (f"cuDNN's sliding window needs at most as many query rows as keys; this block "
                   f"leaves {sq2} rows over {sk2} keys")
    return MaskPlan((r0, r1), (c0, c1), alignment, right, left, refused or _single_pair(sq2, sk2))


def _single_pair(sq: int, sk: int) -> str | None:
    """cuDNN 9.19's sdpa_backward refuses one query over one key ("s_q = s_kv = 1 is not
    supported"; measured on an H200: a one-token document under --document-masking)."""
    if sq == 1 and sk == 1:
        return "cuDNN's sdpa_backward does not take a block of one query and one key"
    return None


def plan_visible(plan: MaskPlan, sq: int, sk: int) -> np.ndarray:
    """The ``[sq, sk]`` boolean mask that cuDNN computes for ``plan``, by cuDNN's documented
    band semantics: top-left, row i and key j of the trimmed block are visible iff
    ``j - i <= right`` and ``i - j < left``; bottom-right, with i shifted by ``Sk' - Sq'``."""
    mask = np.zeros((sq, sk), dtype=bool)
    if plan.empty:
        return mask
    (r0, r1), (c0, c1) = plan.rows, plan.cols
    i = np.arange(r1 - r0)[:, None]
    j = np.arange(c1 - c0)[None, :]
    if plan.alignment == BOTTOM_RIGHT:
        i = i + ((c1 - c0) - (r1 - r0))
    vis = np.ones((r1 - r0, c1 - c0), dtype=bool)
    if plan.right is not None:
        vis &= j - i <= plan.right
    if plan.left is not None:
        vis &= i - j < plan.left
    mask[r0:r1, c0:c1] = vis
    return mask


# ----------------------------------------------------------------------------------------------
# Which cases cuDNN takes (for the `auto` backend choice)
# ----------------------------------------------------------------------------------------------

def supports(dtype: Any, head_dim: int, q_offset: int = 0, k_offset: int = 0,
             causal: bool = True, window: int = 0, sq: int | None = None,
             sk: int | None = None) -> str | None:
    """None if this backend takes the case, else the reason it does not. Without ``sq``/``sk``
    the mask is not checked (every ring and zigzag block of equal-length blocks is taken; a
    sliding window over a block with more query rows than keys left is not)."""
    reason = frontend_unavailable()
    if reason is not None:
        return reason
    try:
        is_bf16 = np.dtype(dtype) == _bf16()
    except Exception as exc:  # ml_dtypes absent
        return f"bfloat16 needs ml_dtypes ({type(exc).__name__}: {exc})"
    if not is_bf16:
        return f"the cuDNN attention backend takes bfloat16 only, not {np.dtype(dtype)}"
    if head_dim % 8 or not 0 < head_dim <= MAX_HEAD_DIM:
        return (f"cuDNN needs a head dim that is a multiple of 8 and <= {MAX_HEAD_DIM}, "
                f"not {head_dim}")
    if sq is not None and sk is not None:
        return mask_plan(sq, sk, q_offset, k_offset, causal, window).refused
    return None


# ----------------------------------------------------------------------------------------------
# Graphs: one per (shapes, strides, mask, scale), built once
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    """One graph tensor: cuDNN's ``[B, H, S, D]`` dims and element strides, and its dtype name."""

    dims: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class GraphSpec:
    """Everything a graph depends on (its cache key). ``kind`` is "fwd" (tensors q, k, v in; o,
    stats out) or "bwd" (q, k, v, o, do, stats in; dq, dk, dv out)."""

    kind: str
    tensors: tuple[tuple[str, TensorSpec], ...]
    scale: float
    alignment: str = TOP_LEFT
    right: int | None = None
    left: int | None = None

    def tensor(self, name: str) -> TensorSpec:
        return dict(self.tensors)[name]


def _data_type(cudnn: ModuleType, name: str) -> Any:
    return {"bfloat16": cudnn.data_type.BFLOAT16, "float32": cudnn.data_type.FLOAT}[name]


def _new_graph(cudnn: ModuleType, handle: int | None, sm_version: int | None) -> Any:
    """An empty graph: bf16 I/O, float32 intermediates and compute. Without a handle the target
    is ``sm_version`` (so it can be built and validated without a device)."""
    kw: dict[str, Any] = dict(io_data_type=cudnn.data_type.BFLOAT16,
                              intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT)
    if handle is not None:
        kw["handle"] = handle
    else:
        kw.update(sm_version=sm_version or 90, sm_count=132)
    return cudnn.pygraph(**kw)


def _mask_kwargs(cudnn: ModuleType, spec: GraphSpec) -> dict[str, Any]:
    kw: dict[str, Any] = {"diagonal_alignment": cudnn.diagonal_alignment.BOTTOM_RIGHT
                          if spec.alignment == BOTTOM_RIGHT else cudnn.diagonal_alignment.TOP_LEFT}
    if spec.right is not None:
        kw["diagonal_band_right_bound"] = int(spec.right)
    if spec.left is not None:
        kw["diagonal_band_left_bound"] = int(spec.left)
    return kw


def define_graph(cudnn: ModuleType, spec: GraphSpec, handle: int | None = None,
                 sm_version: int | None = None) -> tuple[Any, dict[str, Any]]:
    """The sdpa (``spec.kind`` "fwd") or sdpa_backward ("bwd") graph of ``spec``, defined but not
    built: (graph, {tensor name: graph tensor})."""
    g = _new_graph(cudnn, handle, sm_version)
    inputs = ("q", "k", "v") if spec.kind == "fwd" else ("q", "k", "v", "o", "do", "stats")
    t = {n: g.tensor(name=n, dim=list(spec.tensor(n).dims), stride=list(spec.tensor(n).strides),
                     data_type=_data_type(cudnn, spec.tensor(n).dtype)) for n in inputs}
    if spec.kind == "fwd":
        outs = g.sdpa(q=t["q"], k=t["k"], v=t["v"], generate_stats=True, attn_scale=spec.scale,
                      name="sdpa", **_mask_kwargs(cudnn, spec))
        names = ("o", "stats")
    else:
        outs = g.sdpa_backward(q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["do"],
                               stats=t["stats"], attn_scale=spec.scale, name="sdpa_backward",
                               **_mask_kwargs(cudnn, spec))
        names = ("dq", "dk", "dv")
    for name, tensor in zip(names, outs):
        ts = spec.tensor(name)
        tensor.set_output(True).set_dim(list(ts.dims)).set_stride(list(ts.strides)) \
            .set_data_type(_data_type(cudnn, ts.dtype))
        t[name] = tensor
    return g, t


def check_graph(spec: GraphSpec, sm_version: int = 90) -> None:
    """Define, validate and lower ``spec``'s graph for ``sm_version`` without a device (what the
    frontend can check on a host: shapes, dtypes, the support table); raises on refusal."""
    cudnn = _cudnn()
    g, _ = define_graph(cudnn, spec, sm_version=sm_version)
    g.validate()
    g.build_operation_graph()


@dataclass
class _Built:
    graph: Any
    tensors: dict[str, Any]
    workspace: int


_LOCK = threading.Lock()
_HANDLES: dict[int, int] = {}
_GRAPHS: dict[tuple[int, GraphSpec], _Built] = {}


def _handle(cudnn: ModuleType) -> int:
    """This device's cuDNN handle (created once), bound to CuPy's current stream."""
    import cupy
    dev = cupy.cuda.Device().id
    with _LOCK:
        if dev not in _HANDLES:
            _HANDLES[dev] = cudnn.create_handle()
        h = _HANDLES[dev]
    cudnn.set_stream(handle=h, stream=cupy.cuda.get_current_stream().ptr)
    return h


def _built(spec: GraphSpec) -> tuple[_Built, int]:
    """(the built graph of ``spec`` on the current device, the handle); built on first use."""
    import cupy
    cudnn = _cudnn()
    h = _handle(cudnn)
    key = (cupy.cuda.Device().id, spec)
    entry = _GRAPHS.get(key)
    if entry is None:
        g, tensors = define_graph(cudnn, spec, handle=h)
        try:
            g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        except Exception as exc:
            raise CudnnRefused(f"cuDNN built no plan for {spec.kind} {spec.alignment} "
                               f"right={spec.right} left={spec.left}: {exc}") from exc
        entry = _Built(g, tensors, int(g.get_workspace_size()))
        _GRAPHS[key] = entry
    return entry, h


def _execute(spec: GraphSpec, buffers: dict[str, Array]) -> None:
    """Run ``spec``'s graph on CuPy arrays (by name), a workspace from CuPy's pool."""
    import cupy
    entry, h = _built(spec)
    workspace = cupy.empty(max(entry.workspace, 1), dtype=cupy.uint8)
    pack = {entry.tensors[n]: int(a.data.ptr) for n, a in buffers.items()}
    entry.graph.execute(pack, int(workspace.data.ptr), handle=h)


def clear_cache() -> None:
    """Drop every built graph (handles stay)."""
    _GRAPHS.clear()


# ----------------------------------------------------------------------------------------------
# Operands
# ----------------------------------------------------------------------------------------------

def _bhsd(a: Array, dtype: str = "bfloat16") -> TensorSpec:
    """The cuDNN view of a ``[B, S, H, D]`` array: dims and strides in ``[B, H, S, D]`` order."""
    es = [s // a.itemsize for s in a.strides]
    b, s, h, d = a.shape
    return TensorSpec((b, h, s, d), (es[0], es[2], es[1], es[3]), dtype)


def _stats(a: Array) -> TensorSpec:
    """The cuDNN view of a float32 ``[B, H, S]`` statistics array: ``[B, H, S, 1]``."""
    es = [s // a.itemsize for s in a.strides]
    return TensorSpec(tuple(a.shape) + (1,), (es[0], es[1], es[2], 1), "float32")


def forward_spec(plan: MaskPlan, scale: float, arrays: dict[str, Array]) -> GraphSpec:
    """The forward graph's spec for the trimmed block: ``arrays`` q, k, v, o (``[B, S, H, D]``,
    bf16) and stats (``[B, Hq, Sq']`` float32), any array type with shape, strides, itemsize."""
    tensors = tuple((n, _bhsd(arrays[n])) for n in ("q", "k", "v", "o"))
    return GraphSpec("fwd", tensors + (("stats", _stats(arrays["stats"])),), float(scale),
                     plan.alignment, plan.right, plan.left)


def backward_spec(plan: MaskPlan, scale: float, arrays: dict[str, Array],
                  grad_dtype: str = "bfloat16") -> GraphSpec:
    """The backward graph's spec: ``arrays`` q, k, v, o, do (bf16), stats (float32) and the
    gradient buffers dq, dk, dv (``grad_dtype``), laid out as in :func:`forward_spec`."""
    tensors = tuple((n, _bhsd(arrays[n])) for n in ("q", "k", "v", "o", "do"))
    tensors += (("stats", _stats(arrays["stats"])),)
    tensors += tuple((n, _bhsd(arrays[n], grad_dtype)) for n in ("dq", "dk", "dv"))
    return GraphSpec("bwd", tensors, float(scale), plan.alignment, plan.right, plan.left)


def _aligned(a: Array) -> Array:
    """``a`` itself if cuDNN can read it in place (unit innermost stride, 16-byte aligned pointer
    and outer strides), else a C-contiguous copy."""
    import cupy
    ok = (a.strides[-1] == a.itemsize and a.data.ptr % 16 == 0
          and all(s % 16 == 0 for s, n in zip(a.strides[:-1], a.shape[:-1]) if n > 1))
    return a if ok else cupy.ascontiguousarray(a)


def _check_bf16(name: str, **arrays: Array) -> None:
    bf16 = _bf16()
    for key, a in arrays.items():
        require(a.dtype == bf16, f"{name}: {key} must be bfloat16 (ml_dtypes), got {a.dtype}")


def _checked_plan(q: Array, k: Array, q_offset: int, k_offset: int, causal: bool,
                  window: int, name: str) -> MaskPlan:
    """The mask plan of this call; raises CudnnRefused where cuDNN cannot take it."""
    reason = supports(q.dtype, q.shape[3], q_offset, k_offset, causal, window,
                      q.shape[1], k.shape[1])
    if reason is not None:
        raise CudnnRefused(f"{name}: {reason}")
    return mask_plan(q.shape[1], k.shape[1], q_offset, k_offset, causal, window)


# ----------------------------------------------------------------------------------------------
# Forward and backward
# ----------------------------------------------------------------------------------------------

def attention_fwd(q: Array, k: Array, v: Array, q_offset: int = 0, k_offset: int = 0,
                  causal: bool = True, scale: float | None = None,
                  window: int = 0) -> tuple[Array, Array]:
    """numpy_ref.attention_fwd on bf16 CuPy arrays through cuDNN.

    q: `[B, Sq, Hq, D]`, k, v: `[B, Sk, Hkv, D]` bf16 (any strides; unit innermost stride read
    in place) -> out `[B, Sq, Hq, D]` bf16, lse `[B, Hq, Sq]` float32 (natural log of the sum of
    exp(scale q.k) over visible keys); rows with no visible key: out 0, lse -inf.
    Raises CudnnRefused where :func:`supports` refuses the case.
    """
    import cupy
    ref.check_attention_shapes(q, k, v, "attention_fwd")
    ref.check_window(window, causal, "attention_fwd")
    _check_bf16("attention_fwd", q=q, k=k, v=v)
    b, sq, hq, d = q.shape
    plan = _checked_plan(q, k, q_offset, k_offset, causal, window, "attention_fwd")
    full = plan.rows == (0, sq)
    out = cupy.empty(q.shape, q.dtype) if full else cupy.zeros(q.shape, q.dtype)
    lse = cupy.empty((b, hq, sq), np.float32) if full else cupy.full((b, hq, sq), -np.inf,
                                                                      np.float32)
    if plan.empty or b == 0:
        return out, lse
    (r0, r1), (c0, c1) = plan.rows, plan.cols
    qb, kb, vb = _aligned(q[:, r0:r1]), _aligned(k[:, c0:c1]), _aligned(v[:, c0:c1])
    ob = out[:, r0:r1]
    stats = lse if full else cupy.empty((b, hq, r1 - r0), np.float32)
    spec = forward_spec(plan, ref.attention_scale(d, scale),
                        {"q": qb, "k": kb, "v": vb, "o": ob, "stats": stats})
    _execute(spec, {"q": qb, "k": kb, "v": vb, "o": ob, "stats": stats})
    if not full:
        lse[:, :, r0:r1] = stats
    return out, lse


GRAD_DTYPE = "bfloat16"
"""The dtype sdpa_backward writes dq, dk, dv in; they are widened to the contract's float32 here
(one bf16 rounding, 2^-9 relative, before the caller's float32 accumulation over ring hops and
microbatches). Never float32: on an H100 with cuDNN 9.19 the frontend validates float32
gradients, but with grouped-query heads no engine builds a plan, and without them the plan that
builds returns a wrong dq (relative error 1.2; measured)."""


def _bf16_grads(plan: MaskPlan, q: Array, k: Array) -> tuple[Array, Array, Array]:
    """bf16 buffers for cuDNN's dq, dk, dv of the trimmed block."""
    import cupy
    (r0, r1), (c0, c1) = plan.rows, plan.cols
    b, _, hq, d = q.shape
    hkv = k.shape[2]
    return (cupy.empty((b, r1 - r0, hq, d), q.dtype), cupy.empty((b, c1 - c0, hkv, d), q.dtype),
            cupy.empty((b, c1 - c0, hkv, d), q.dtype))


def attention_bwd(q: Array, k: Array, v: Array, out: Array, lse: Array, dout: Array,
                  q_offset: int = 0, k_offset: int = 0, causal: bool = True,
                  scale: float | None = None, window: int = 0, grad_dtype: Any = None
                  ) -> tuple[Array, Array, Array]:
    """numpy_ref.attention_bwd on bf16 CuPy arrays through cuDNN's sdpa_backward.

    q, out, dout: `[B, Sq, Hq, D]` bf16, k, v: `[B, Sk, Hkv, D]` bf16, lse: `[B, Hq, Sq]` float32
    (``out``/``lse`` may be merged over several key blocks) -> dq `[B, Sq, Hq, D]`, dk, dv
    `[B, Sk, Hkv, D]`, float32, or bf16 when ``grad_dtype`` asks (cuDNN writes bf16: then its
    buffers are returned as they are, no float32 copy). Rows that see no key here get dq 0, keys
    no row sees dk = dv = 0.
    """
    import cupy
    grads = ref.grad_dtype_of(q.dtype, grad_dtype)
    ref.check_attention_shapes(q, k, v, "attention_bwd")
    ref.check_window(window, causal, "attention_bwd")
    _check_bf16("attention_bwd", q=q, k=k, v=v, out=out, dout=dout)
    b, sq, hq, d = q.shape
    require(out.shape == q.shape and dout.shape == q.shape and lse.shape == (b, hq, sq),
            f"attention_bwd: out {out.shape}, dout {dout.shape} must be {q.shape} and lse "
            f"{lse.shape} must be {(b, hq, sq)}")
    plan = _checked_plan(q, k, q_offset, k_offset, causal, window, "attention_bwd")
    if plan.empty or b == 0:
        return cupy.zeros(q.shape, grads), cupy.zeros(k.shape, grads), cupy.zeros(k.shape, grads)
    (r0, r1), (c0, c1) = plan.rows, plan.cols
    ins = {"q": _aligned(q[:, r0:r1]), "k": _aligned(k[:, c0:c1]), "v": _aligned(v[:, c0:c1]),
           "o": _aligned(out[:, r0:r1]), "do": _aligned(dout[:, r0:r1]),
           "stats": cupy.ascontiguousarray(lse[:, :, r0:r1], dtype=np.float32)}
    outs = dict(zip(("dq", "dk", "dv"), _bf16_grads(plan, q, k)))
    spec = backward_spec(plan, ref.attention_scale(d, scale), {**ins, **outs}, GRAD_DTYPE)
    _execute(spec, {**ins, **outs})
    if (r0, r1, c0, c1) == (0, sq, 0, k.shape[1]):   # every row and key: no zero margins
        return tuple(outs[n].astype(grads, copy=False) for n in ("dq", "dk", "dv"))
    dq = cupy.zeros(q.shape, grads)
    dk, dv = cupy.zeros(k.shape, grads), cupy.zeros(k.shape, grads)
    dq[:, r0:r1] = outs["dq"].astype(grads, copy=False)
    dk[:, c0:c1] = outs["dk"].astype(grads, copy=False)
    dv[:, c0:c1] = outs["dv"].astype(grads, copy=False)
    return dq, dk, dv


__all__ = ["CudnnRefused", "MaskPlan", "GraphSpec", "TensorSpec", "attention_fwd", "attention_bwd",
           "mask_plan", "plan_visible", "forward_spec", "backward_spec", "supports",
           "frontend_unavailable", "define_graph", "check_graph", "clear_cache", "GRAD_DTYPE",
           "FRONTEND_REQUIREMENT"]
