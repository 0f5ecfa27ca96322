"""The optimizer: AdamW, replicated or ZeRO-1 sharded behind one interface, gradient-norm
clipping and learning-rate schedules.

Both optimizers implement :class:`Optimizer`, so the engine never asks which one it has:

- :class:`AdamW` updates whole local shards; its moments are replicated over dp x sp like the
  parameters, so one replica (``replica.rank == 0``) reports them as checkpoint state.
- :class:`ZeroAdamW` (``--zero 1``) updates only this rank's owned slice of every flat gradient
  bucket (the data-parallel reducer reduce-scatters them, :mod:`mpipar.parallel.data_parallel`); its
  moments are 1/n of the full size, its gradient norm is summed over dp x sp, and the updated
  slices are all-gathered back into every rank's parameters.

With top-k gradient compression and error feedback, a step's gradient is a sparse sum: a zero
is a coordinate whose gradient still waits in some rank's residual. There both optimizers use
:func:`adamw_catch_up` (``--topk-catch-up``, on by default): a coordinate moves when its gradient
arrives, as many steps as it waited, instead of one step with an inflated second moment.

The update math (:func:`adamw_update`, :func:`adamw_catch_up`, :func:`clip_coefficient`,
:func:`grad_norm_sq`) talks to no MPI. Arrays may be NumPy or CuPy (the array module is the
arrays'); updates are in place and in the arrays' dtype. Under mixed precision the optimizer
sees only float32 arrays: the master weights (whole, or ZeRO's owned slices), the float32
gradients and moments; the reducer refreshes the bf16 compute copies after each step.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mpipar import kernels
from mpipar.runtime.comm import Group
from mpipar.config import ConfigError, TrainConfig
from mpipar.layout import Layout


def _array_module(a: Any) -> Any:
    """numpy, or cupy for cupy arrays (without importing cupy otherwise)."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np


@dataclass
class AdamWConfig:
    """AdamW hyper-parameters (decoupled weight decay, as torch.optim.AdamW)."""

    lr: float
    """Peak learning rate; the schedule may scale it per step."""
    beta1: float = 0.9
    """Decay rate of the first moment (mean of gradients)."""
    beta2: float = 0.95
    """Decay rate of the second moment (mean of squared gradients)."""
    eps: float = 1e-8
    """Added to the bias-corrected root of the second moment."""
    weight_decay: float = 0.1
    """Decoupled decay: each step multiplies decayed parameters by 1 - lr * weight_decay."""

    def __post_init__(self) -> None:
        if not self.lr >= 0:
            raise ValueError(f"lr={self.lr}: must be >= 0")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay={self.weight_decay}: must be >= 0")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"{name}={value}: must be in [0, 1)")
        if not self.eps > 0:
            raise ValueError(f"eps={self.eps}: must be > 0")


def adamw_update(p: Any, g: Any, m: Any, v: Any, step: int, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: float, scale: float = 1.0) -> None:
    """One AdamW step, in place on `p` (parameters), `m`, `v` (moments), all the same shape.

    `step` is the 1-based count of updates including this one (bias correction uses
    beta**step). ``scale``: the clipping coefficient, applied to ``g`` first (``g * scale``
    rounded in g's dtype, as scaling the gradient in place would be; ``g`` itself is left as it
    is). Works on arrays of any shape, including views into flat buffers:

        g  = g * scale                 (when scale != 1)
        p *= 1 - lr * weight_decay
        m  = beta1 * m + (1 - beta1) * g
        v  = beta2 * v + (1 - beta2) * g * g
        p -= lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)

    Scalars are Python floats, so the arithmetic stays in the arrays' dtype. CuPy arrays of one
    dtype take the fused pass (:func:`mpipar.kernels.fused_adamw`: the same operations in the
    same order, the same bits).
    """
    if not p.shape == g.shape == m.shape == v.shape:
        raise ValueError(f"adamw_update needs equal shapes, got p {p.shape}, g {g.shape}, "
                         f"m {m.shape}, v {v.shape}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count including this update), got {step}")
    xp = _array_module(p)
    if xp is not np and p.dtype == g.dtype == m.dtype == v.dtype:
        kernels.fused_adamw(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay, scale)
        return
    if scale != 1.0:
        g = g * scale
    if weight_decay != 0:
        p *= 1.0 - lr * weight_decay
    scratch = xp.empty_like(m)
    xp.multiply(g, 1.0 - beta1, out=scratch)
    m *= beta1
    m += scratch
    xp.multiply(g, g, out=scratch)
    scratch *= 1.0 - beta2
    v *= beta2
    v += scratch
    xp.sqrt(v, out=scratch)
    scratch /= math.sqrt(1.0 - beta2 ** step)
    scratch += eps
    xp.divide(m, scratch, out=scratch)
    scratch *= lr / (1.0 - beta1 ** step)
    p -= scratch


def adamw_catch_up(p: Any, g: Any, m: Any, v: Any, idle: Any, step: int, lr: float,
                   beta1: float, beta2: float, eps: float, weight_decay: float,
                   scale: float = 1.0) -> None:
    """One AdamW step on a sum of top-k selections with error feedback, in place on ``p``,
    ``m``, ``v`` and ``idle`` (steps each coordinate has waited), all the same shape.

    A zero in ``g`` is a coordinate no rank sent: its gradient waits in the residuals, so it
    waits too (``idle`` + 1; only the weight decay applies). A coordinate sent after
    d = idle + 1 steps carries the gradients of those d steps. Plain AdamW would take that sum
    as one gradient: the second moment grows with d^2 and the coordinate moves one step, so a
    coordinate that waits d steps learns about d times slower (measured: top-k 1 % was 19 %
    behind the uncompressed loss). Here it is taken as d equal gradients g / d, the moments
    decay d steps toward them and the parameter moves d steps' worth (the lazy Adam of sparse
    embeddings, with the wait counted)::

        p   *= 1 - lr * weight_decay
        d    = idle + 1,  gbar = g / d                  (sent coordinates only)
        m    = beta1**d * m + (1 - beta1**d) * gbar
        v    = beta2**d * v + (1 - beta2**d) * gbar**2
        p   -= d * lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)
        idle = 0 where sent, idle + 1 elsewhere

    With every coordinate sent (d = 1) this is :func:`adamw_update`'s arithmetic; ``scale``
    (the clipping coefficient) multiplies ``g`` first, as there."""
    if not p.shape == g.shape == m.shape == v.shape == idle.shape:
        raise ValueError(f"adamw_catch_up needs equal shapes, got p {p.shape}, g {g.shape}, "
                         f"m {m.shape}, v {v.shape}, idle {idle.shape}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count including this update), got {step}")
    if scale != 1.0:
        g = g * scale
    if weight_decay != 0:
        p *= 1.0 - lr * weight_decay
    idle += 1
    sent = g != 0
    d = idle[sent]
    gbar = g[sent] / d
    decay1, decay2 = beta1 ** d, beta2 ** d
    ms = decay1 * m[sent] + (1.0 - decay1) * gbar
    vs = decay2 * v[sent] + (1.0 - decay2) * (gbar * gbar)
    m[sent], v[sent] = ms, vs
    p[sent] -= d * (lr / (1.0 - beta1 ** step)) * ms / (
        (vs ** 0.5) / math.sqrt(1.0 - beta2 ** step) + eps)
    idle[sent] = 0


def _adamw_step(p: Any, g: Any, m: Any, v: Any, idle: Any | None, step: int, lr: float,
                cfg: AdamWConfig, weight_decay: float, scale: float) -> None:
    """:func:`adamw_catch_up` with the wait counts ``idle``, :func:`adamw_update` without."""
    if idle is None:
        adamw_update(p, g, m, v, step, lr, cfg.beta1, cfg.beta2, cfg.eps, weight_decay, scale)
    else:
        adamw_catch_up(p, g, m, v, idle, step, lr, cfg.beta1, cfg.beta2, cfg.eps, weight_decay,
                       scale)


IDLE = "idle_steps"
"""The state kind of :func:`adamw_catch_up`'s wait counts (in checkpoints beside the moments)."""

StatePiece = tuple[str, str, int, int, Any]
"""``(kind, name, lo, hi, values)``: ``values`` (1-D) are elements ``[lo, hi)`` of the flattened
local shard of moment ``kind`` ("exp_avg" or "exp_avg_sq") of parameter ``name``."""


class Optimizer(Protocol):
    """What the engine and checkpoints ask of an optimizer (:class:`AdamW`, :class:`ZeroAdamW`)."""

    step_count: int
    """Updates applied so far (AdamW's bias correction uses it)."""

    def grad_norm_sq(self, counted: Callable[[str], bool]) -> float:
        """Sum of squares of the gradients of the parameters ``counted`` accepts, over this rank's
        model replica shard (a sharded optimizer sums its shard group itself)."""

    def clip(self, max_norm: float, total_norm: float) -> float:
        """Clip the gradients to a global norm of at most ``max_norm``: the coefficient
        (:func:`clip_coefficient`) is returned and applied by the next :meth:`step` as it reads
        each gradient (the same bits as scaling the gradients in place first, one pass fewer
        over them); the gradient buffers themselves are left unscaled."""

    def step(self, lr: float) -> None:
        """Apply one update at learning rate ``lr`` to the parameters (with the coefficient of
        the last :meth:`clip` since the previous step, if any)."""

    def state(self) -> Iterator[StatePiece]:
        """This rank's share of the moments: each element of the model's optimizer state is
        reported by exactly one rank of the dp x sp group."""

    def load_state(self, local: Callable[[str, str], Any], step: int,
                   kinds: Collection[str] = ()) -> None:
        """Set the moments from ``local(kind, name)`` (this rank's whole local shard of that
        moment, from a checkpoint of any layout) and the update count from ``step``; other
        state of the optimizer from those of ``kinds`` (what the source holds beyond
        parameters and moments) it has."""


class AdamW:
    """AdamW over named tensors (whole tensors or this rank's shards), updated in place.

    params, grads: name -> array, the gradients filled by backward; the moments m, v are zero
    arrays of the same shapes and dtypes. decay: name -> whether weight decay applies; default
    True iff the array is at least 2-D (matrices and embeddings decay; norms' gains do not).
    When ``params`` hold shards, pass the mask computed from the global shapes. replica: the
    group over which the parameters (and so these moments) are replicated; its rank 0 reports
    the moments in :meth:`state`. publish: called after each update (the reducer's
    ``gather_params``: the bf16 compute copies refreshed from these master weights).
    """

    def __init__(self, params: Mapping[str, Any], grads: Mapping[str, Any], cfg: AdamWConfig,
                 decay: Mapping[str, bool] | None = None, replica: Group | None = None,
                 catch_up: Callable[[], bool] | None = None,
                 publish: Callable[[], None] | None = None):
        if decay is None:
            decay = {name: p.ndim >= 2 for name, p in params.items()}
        _check_names("decay mask", decay.keys(), params.keys())
        _check_names("grads", grads.keys(), params.keys())
        self.params, self.grads, self.cfg, self.replica = params, grads, cfg, replica
        self.decay = {name: bool(decay[name]) for name in params}
        self.m = {name: _array_module(p).zeros_like(p) for name, p in params.items()}
        self.v = {name: _array_module(p).zeros_like(p) for name, p in params.items()}
        self.catch_up, self.publish = catch_up, publish
        self.idle = ({name: _array_module(p).zeros_like(p) for name, p in params.items()}
                     if catch_up is not None else {})
        self.step_count = 0
        self.grad_scale = 1.0

    def grad_norm_sq(self, counted: Callable[[str], bool] | None = None) -> float:
        return grad_norm_sq(self.grads, counted)

    def clip(self, max_norm: float, total_norm: float) -> float:
        self.grad_scale = clip_coefficient(max_norm, total_norm)
        return self.grad_scale

    def step(self, lr: float) -> None:
        """Update every parameter in place with its gradient (times the clipping coefficient)
        at learning rate ``lr``."""
        self.step_count += 1
        cfg, scale, self.grad_scale = self.cfg, self.grad_scale, 1.0
        sparse = self.catch_up is not None and self.catch_up()
        for name, p in self.params.items():
            wd = cfg.weight_decay if self.decay[name] else 0.0
            _adamw_step(p, self.grads[name], self.m[name], self.v[name],
                        self.idle[name] if sparse else None, self.step_count, lr, cfg, wd, scale)
        if self.publish is not None:
            self.publish()

    def state(self) -> Iterator[StatePiece]:
        """The live moments, whole, from the replica of rank 0 (save them before the next step)."""
        if self.replica is not None and self.replica.rank != 0:
            return
        for name in self.params:
            size = self.m[name].size
            yield "exp_avg", name, 0, size, self.m[name].reshape(-1)
            yield "exp_avg_sq", name, 0, size, self.v[name].reshape(-1)
            if self.catch_up is not None:
                yield IDLE, name, 0, size, self.idle[name].reshape(-1)

    def load_state(self, local: Callable[[str, str], Any], step: int,
                   kinds: Collection[str] = ()) -> None:
        """Copy the moments in (they keep their dtype and device), and the wait counts of
        :func:`adamw_catch_up` when ``kinds`` (what the source holds beyond parameters and
        moments) has them (else they start at 0); ValueError on a step below 0 or a moment
        whose shape differs from its parameter's."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"optimizer step={step!r}: must be an integer >= 0")
        for arr in self.idle.values():
            arr.fill(0)
        held = [(IDLE, self.idle)] if self.idle and IDLE in kinds else []
        for kind, moments in (("exp_avg", self.m), ("exp_avg_sq", self.v), *held):
            for name, arr in moments.items():
                value = local(kind, name)
                if tuple(value.shape) != tuple(arr.shape):
                    raise ValueError(f"optimizer state {kind} of {name} has shape "
                                     f"{tuple(value.shape)}, the parameter {tuple(arr.shape)}")
                arr[...] = _array_module(arr).asarray(value, dtype=arr.dtype)
        self.step_count = int(step)


class ZeroAdamW:
    """AdamW over the owned slices of a sharded reducer: ZeRO-1's
    :class:`mpipar.parallel.data_parallel.reducer.GradReducer` with ``sharded=True`` (which says which slice a rank
    owns: flat or following the node split), or ZeRO-2/3's
    :class:`mpipar.parallel.fsdp.sharded.ShardedParams`. Each bucket (or unit) exposes ``owned`` (the
    parameters this rank updates) and ``owned_grad``; moments are the size of ``owned_grad``;
    the reducer puts the updated slices back (``gather_params``). ``skip``: parameters another
    optimizer updates and reports (:class:`mpipar.training.optimizers.Muon`'s matrices)."""

    def __init__(self, reducer, cfg: AdamWConfig, decay: Mapping[str, bool],
                 catch_up: Callable[[], bool] | None = None,
                 skip: Collection[str] = frozenset()) -> None:
        self.reducer, self.cfg, self.decay = reducer, cfg, decay
        self.skip = frozenset(skip)   # parameters another optimizer updates (Muon's matrices)
        xp = reducer.xp
        self._index = {id(b): i for i, b in enumerate(reducer.buckets)}
        self.m = [xp.zeros_like(b.owned_grad) for b in reducer.buckets]
        # The second moment of the elements AdamW updates: the whole owned slice, or beside
        # ``skip`` parameters (whose optimizer keeps the first moment only) just the rest's.
        self._v_at: dict[tuple[int, int], int] = {}
        if self.skip:
            sizes = [0] * len(reducer.buckets)
            for b, name, lo, hi in reducer.owned_pieces():
                if name not in self.skip:
                    i = self._index[id(b)]
                    self._v_at[i, lo] = sizes[i] - lo
                    sizes[i] += hi - lo
            self.v = [xp.zeros(k, b.owned_grad.dtype) for k, b in zip(sizes, reducer.buckets)]
        else:
            self.v = [xp.zeros_like(b.owned_grad) for b in reducer.buckets]
        self.catch_up = catch_up
        self.idle = ([xp.zeros_like(b.owned_grad) for b in reducer.buckets]
                     if catch_up is not None else [])
        self.step_count = 0
        self.grad_scale = 1.0

    def _second(self, i: int, lo: int, hi: int) -> Any:
        """The second moment of owned slice ``[lo, hi)`` of bucket ``i`` (a parameter's piece)."""
        shift = self._v_at.get((i, lo), 0)
        return self.v[i][lo + shift:hi + shift]

    def first_moment(self, b, lo: int, hi: int) -> Any:
        """The first-moment view of owned slice ``[lo, hi)`` of bucket ``b``: the state a
        ``skip`` parameter's optimizer keeps there (Muon's momentum)."""
        return self.m[self._index[id(b)]][lo:hi]

    def grad_norm_sq(self, counted: Callable[[str], bool]) -> float:
        """Sum of squares of the owned gradient slices ``counted`` accepts, over the shard group
        (one all-reduce)."""
        total = sum_squares(b.owned_grad[lo:hi] for b, name, lo, hi in
                            self.reducer.owned_pieces() if counted(name))
        xp = self.reducer.xp
        return float(self.reducer.group.allreduce_(xp.array([total]))[0])

    def clip(self, max_norm: float, total_norm: float) -> float:
        self.grad_scale = clip_coefficient(max_norm, total_norm)
        return self.grad_scale

    def step(self, lr: float) -> None:
        self.step_count += 1
        red, c, scale, self.grad_scale = self.reducer, self.cfg, self.grad_scale, 1.0
        sparse = self.catch_up is not None and self.catch_up()
        for b, name, lo, hi in red.owned_pieces():
            if name in self.skip:
                continue
            i = self._index[id(b)]
            wd = c.weight_decay if self.decay[name] else 0.0
            _adamw_step(b.owned[lo:hi], b.owned_grad[lo:hi], self.m[i][lo:hi],
                        self._second(i, lo, hi), self.idle[i][lo:hi] if sparse else None,
                        self.step_count, lr, c, wd, scale)
        red.gather_params()

    def _pieces(self):
        """(bucket index, name, lo, hi, start in the flattened local shard) of owned slices."""
        for b, name, lo, hi in self.reducer.owned_pieces():
            if name in self.skip:
                continue
            a0, _ = self.reducer.owned_range(b)
            yield self._index[id(b)], name, lo, hi, a0 + lo - b.offsets[name][0]

    def state(self) -> Iterator[StatePiece]:
        for i, name, lo, hi, start in self._pieces():
            yield "exp_avg", name, start, start + hi - lo, self.m[i][lo:hi]
            yield "exp_avg_sq", name, start, start + hi - lo, self._second(i, lo, hi)
            if self.catch_up is not None:
                yield IDLE, name, start, start + hi - lo, self.idle[i][lo:hi]

    def load_state(self, local: Callable[[str, str], Any], step: int,
                   kinds: Collection[str] = ()) -> None:
        xp = self.reducer.xp
        for arr in self.idle:
            arr.fill(0)
        held = [(IDLE, self.idle)] if self.idle and IDLE in kinds else []
        for i, name, lo, hi, start in self._pieces():
            views = [("exp_avg", self.m[i][lo:hi]), ("exp_avg_sq", self._second(i, lo, hi)),
                     *((kind, arrays[i][lo:hi]) for kind, arrays in held)]
            for kind, view in views:
                view[...] = xp.asarray(local(kind, name).reshape(-1)[start:start + hi - lo])
        self.step_count = int(step)


class ExpertSplitOptimizer:
    """The optimizers of the dense weights and of this rank's experts (sharded over ep:
    :class:`mpipar.parallel.experts.ExpertSplitReducer`), as one: the experts' share of the
    squared gradient norm is summed over ``ep`` (each expert held at one ep position) and added
    to the dense share; clipping, updates and state are each one's."""

    def __init__(self, dense: Optimizer, experts: Optimizer, ep: Group, xp: Any) -> None:
        self.dense, self.experts, self.ep, self.xp = dense, experts, ep, xp

    @property
    def step_count(self) -> int:
        return self.dense.step_count

    def grad_norm_sq(self, counted: Callable[[str], bool]) -> float:
        mine = self.experts.grad_norm_sq(counted)
        dense = self.dense.grad_norm_sq(counted)      # its collectives first, as before
        return dense + float(self.ep.allreduce_(self.xp.array([mine]))[0])

    def clip(self, max_norm: float, total_norm: float) -> float:
        self.experts.clip(max_norm, total_norm)
        return self.dense.clip(max_norm, total_norm)

    def step(self, lr: float) -> None:
        self.dense.step(lr)
        self.experts.step(lr)

    def state(self) -> Iterator[StatePiece]:
        yield from self.dense.state()
        yield from self.experts.state()

    def load_state(self, local: Callable[[str, str], Any], step: int,
                   kinds: Collection[str] = ()) -> None:
        self.dense.load_state(local, step, kinds)
        self.experts.load_state(local, step, kinds)


def build_optimizer(zero: int, reducer, cfg: AdamWConfig, decay: Mapping[str, bool],
                    catch_up: bool = False) -> Optimizer:
    """The optimizer of ZeRO stage ``zero`` (0: :class:`AdamW`, 1-3: :class:`ZeroAdamW`) over
    the master weights of ``reducer`` (its compute copies refreshed after each update); with
    ``catch_up``, steps whose gradients are sparse sums
    (``reducer.sparse_sums``: top-k with error feedback, past the warm-up) use
    :func:`adamw_catch_up`."""
    sparse = (lambda: reducer.sparse_sums) if catch_up else None
    if hasattr(reducer, "experts"):      # the experts sharded over ep: an optimizer each
        parts = [{n: decay[n] for n in part.local_shapes()}
                 for part in (reducer.dense, reducer.experts)]
        return ExpertSplitOptimizer(build_optimizer(zero, reducer.dense, cfg, parts[0], catch_up),
                                    build_optimizer(zero, reducer.experts, cfg, parts[1]),
                                    reducer.ep, reducer.xp)
    if zero:
        return ZeroAdamW(reducer, cfg, decay, sparse)
    return AdamW(reducer.masters, reducer.grads, cfg, decay, reducer.group, sparse,
                 publish=reducer.gather_params)


def _check_names(what: str, got: Any, expected: Any) -> None:
    got, expected = set(got), set(expected)
    if got != expected:
        raise ValueError(f"{what} names differ from the parameters: missing {sorted(expected - got)}, "
                         f"unexpected {sorted(got - expected)}")


def grad_norm_sq(grads: Mapping[str, Any], include: Callable[[str], bool] | None = None) -> float:
    """Sum of squares of this rank's gradients whose name passes `include` (default all),
    accumulated in float64. The global norm is sqrt of the sum over ranks."""
    return sum_squares(grads[name] for name in sorted(grads)
                       if include is None or include(name))


def sum_squares(arrays: Iterable[Any]) -> float:
    """Sum over ``arrays`` of the sum of squares of each, accumulated in float64 (a float32
    element's square is exact there). NumPy: a dot product per array. CuPy: the fused kernel
    (:func:`mpipar.kernels.device_sum_squares`: float64 partials per block, one
    synchronisation). A dot per array cast to float64 cost a full-size copy and a
    synchronisation each: 26 ms for a 1.1B model's gradients on an H200; CuPy's reduction
    kernel per array 7.5 ms."""
    total, on_device = 0.0, []
    for g in arrays:
        flat = g.reshape(-1)
        if _array_module(flat) is np:
            if flat.dtype != np.float64:
                flat = flat.astype(np.float64)
            total += float(np.dot(flat, flat))
        else:
            on_device.append(flat)
    if on_device:
        total += kernels.device_sum_squares(on_device)
    return total


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """The factor that brings gradients of global norm ``total_norm`` to at most ``max_norm``:
    min(1, max_norm / (total_norm + 1e-6)), as torch.nn.utils.clip_grad_norm_; 1.0 when
    clipping is off (max_norm <= 0). A non-finite or negative total_norm raises ValueError
    rather than silently zeroing or poisoning the gradients. The optimizers fold it into their
    update (:func:`adamw_update`'s ``scale``)."""
    if max_norm <= 0:
        return 1.0
    if not (math.isfinite(total_norm) and total_norm >= 0):
        raise ValueError(f"total_norm must be finite and >= 0 to clip, got {total_norm}")
    return min(1.0, max_norm / (total_norm + 1e-6))


SCHEDULES = ("constant", "cosine", "wsd")
"""The learning-rate schedules (:class:`LRSchedule`'s ``kind``)."""

DECAY_SHAPES = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "sqrt": lambda p: 1.0 - math.sqrt(p),
}
"""The decay shapes of the wsd schedule: the fraction f(p) of (lr - min_lr) left at decay
progress p in [0, 1] (f(0) = 1, f(1) = 0)."""


@dataclass
class LRSchedule:
    """Learning rate of each optimizer step: linear warm-up, then constant, cosine decay, or
    warmup-stable-decay (wsd).

    With ``s`` the 0-based step, W = ``warmup_steps``, N = ``total_steps``::

        s < W:     lr * (s + 1) / W                                  (every kind)
        constant:  lr
        cosine:    min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2,   p = min(1, (s - W) / (N - W))
        wsd:       lr                                                for s < S
                   min_lr + (lr - min_lr) * f(p)                     for s >= S,
                   D = max(1, floor(F * N + 1/2))   (F = decay_fraction: the decay's steps)
                   S = max(W, N - D)                (the first decaying step)
                   p = min(1, (s + 1 - S) / (N - S))
                   f(p) = 1 - p (linear), (1 + cos(pi * p)) / 2 (cosine), 1 - sqrt(p) (sqrt)

    wsd holds ``lr`` until the last D steps (those after warm-up, if fewer), whose learning
    rates fall to ``min_lr``, reached at the last step (s = N - 1). Before S the learning rate
    does not depend on N: a run resumed from a checkpoint taken at step k <= S with a larger N
    has the learning rate, at every step, of a run started with that N (how a wsd run is
    extended). sqrt is the "1 - sqrt" cool-down of the WSD papers (Hägele et al., 2024).
    """

    kind: str
    """One of :data:`SCHEDULES`."""
    lr: float
    """Peak learning rate, reached at the end of warm-up."""
    min_lr: float = 0.0
    """Final learning rate of the decay (ignored by "constant")."""
    warmup_steps: int = 0
    """Steps of linear warm-up: step s < warmup_steps gets lr * (s + 1) / warmup_steps."""
    total_steps: int = 1
    """The run's steps: the cosine reaches min_lr at step total_steps, wsd at its last step
    (total_steps - 1)."""
    decay_fraction: float = 0.0
    """wsd: the fraction of ``total_steps`` that decays, in (0, 1]; 0 for the other kinds."""
    decay_shape: str = "linear"
    """wsd: one of :data:`DECAY_SHAPES`; "linear" for the other kinds."""

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"kind={self.kind!r}: must be "
                             + " or ".join(repr(k) for k in SCHEDULES))
        if not self.lr >= 0:
            raise ValueError(f"lr={self.lr}: must be >= 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr={self.min_lr}: must be in [0, lr={self.lr}]")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps}: must be >= 0")
        if self.total_steps < 1:
            raise ValueError(f"total_steps={self.total_steps}: must be >= 1")
        self._check_decay()

    def _check_decay(self) -> None:
        """The wsd fields: a decay fraction in (0, 1] and a known shape with wsd, neither set
        with another kind."""
        if self.decay_shape not in DECAY_SHAPES:
            raise ValueError(f"decay_shape={self.decay_shape!r}: must be one of "
                             f"{', '.join(DECAY_SHAPES)}")
        if self.kind == "wsd":
            if not 0 < self.decay_fraction <= 1:
                raise ValueError(f"decay_fraction={self.decay_fraction}: the wsd schedule needs "
                                 f"the fraction of the steps that decays, in (0, 1]")
            return
        if self.decay_fraction != 0:
            raise ValueError(f"decay_fraction={self.decay_fraction}: only with the wsd "
                             f"schedule (the schedule is {self.kind!r})")
        if self.decay_shape != "linear":
            raise ValueError(f"decay_shape={self.decay_shape!r}: only with the wsd schedule "
                             f"(the schedule is {self.kind!r})")

    @property
    def extends(self) -> bool:
        """Whether a run resumed from a checkpoint before its decay with more steps continues
        as a run started with them (wsd: the decay moves to the new end)."""
        return self.kind == "wsd"

    @property
    def decay_start(self) -> int:
        """The first 0-based step below the peak after warm-up: S for wsd, ``warmup_steps`` + 1
        for the cosine, ``total_steps`` (never) for "constant"."""
        if self.kind == "constant":
            return self.total_steps
        if self.kind == "cosine":
            return self.warmup_steps + 1
        decay = max(1, math.floor(self.decay_fraction * self.total_steps + 0.5))
        return max(self.warmup_steps, self.total_steps - decay)

    def __call__(self, step: int) -> float:
        """Learning rate for the optimizer step about to be taken (`step` is 0-based)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.lr
        if self.kind == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(1.0, max(0.0, (step - self.warmup_steps) / span))
            return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))
        start = self.decay_start
        if step < start:
            return self.lr
        progress = min(1.0, (step + 1 - start) / max(1, self.total_steps - start))
        return self.min_lr + (self.lr - self.min_lr) * DECAY_SHAPES[self.decay_shape](progress)

    @classmethod
    def of(cls, train: TrainConfig) -> LRSchedule:
        """The schedule a run's train section (:class:`mpipar.config.TrainConfig`) asks for."""
        return cls(train.lr_schedule, train.lr, train.min_lr, train.warmup_steps,
                   max(1, train.steps), train.decay_fraction, train.decay_shape)


def extends_with_steps(train: TrainConfig) -> bool:
    """:attr:`LRSchedule.extends` of a train section's schedule (what a resumed run's report of
    a changed ``steps`` asks, :func:`mpipar.checkpoint.reader.resume_changes`)."""
    return LRSchedule.of(train).extends


def check_config(layout: Layout) -> None:
    """AdamW's hyper-parameters and the LR schedule, as they validate themselves."""
    t = layout.train
    try:
        AdamWConfig(t.lr, t.beta1, t.beta2, t.eps, t.weight_decay)
        LRSchedule.of(t)
    except ValueError as exc:
        raise ConfigError(f"train.{exc}") from None
