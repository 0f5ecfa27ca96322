"""What the planner measures of one rank on this machine, as ``train`` runs it: a GEMM of the
model's own shape, the cost of one kernel call, and the rate of a memory-bound pass over an
activation, each on a rank's share of the node's cores.

A step of a small model is far from its FLOPs over the GEMM peak: its GEMMs are small
(``[tokens, hidden] @ [hidden, hidden]`` runs at a fraction of a large GEMM's rate), and the
norms, RoPE, softmax, SwiGLU, residual adds, cross-entropy and the optimizer are memory-bound
passes and Python/NumPy dispatch, paid per kernel call. :mod:`mpipar.plan.step_time` counts the
FLOPs, the elements every pass touches and the kernel calls; this module measures the three
rates they are divided by.

Each rate is the median over ``repeats`` windows of the fastest call in each window
(:func:`mpipar.runtime.peak.windowed_best`): a moment of other work on the cores does not set
it, one lucky or disturbed window does not either, and the spread between the slowest and the
fastest window says how much the machine disturbed the probe.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

GEMM_MAX_ROWS, GEMM_MAX_WIDTH = 1024, 1024
"""The probe's GEMM is ``[seq_len, hidden] @ [hidden, hidden]``, each dimension capped at
these (a large model's GEMMs run at the large-GEMM rate anyway, and the probe stays short)."""
PASS_ELEMENTS = (1 << 14, 1 << 22)
"""Bounds of the elements of the probe's memory-bound pass: one sequence's activations
``seq_len x hidden``."""


@dataclass(frozen=True)
class Rate:
    """A probed quantity: the median over windows and the slowest and fastest window's."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> "Rate":
        return cls(statistics.median(values), min(values), max(values))

    @property
    def spread(self) -> float:
        """(largest - smallest window) / median."""
        return (self.high - self.low) / self.median


@dataclass(frozen=True)
class ModelFit:
    """One rank's forward and backward through the model's own code (one block, the embedding,
    the LM head and the loss, :func:`probe_model`) on ``rows`` sequences of ``tokens`` tokens:
    ``seconds`` (CPU seconds of one thread, or wall seconds with more), and what it says: with
    each kernel call costing what a call on one token costs, each FLOP of the time model costs
    ``1 / rate`` seconds (the GEMMs with the memory-bound passes and the Python work that grow
    with them)."""

    seconds: Rate
    tokens: int
    rows: int
    rate: float

    @classmethod
    def of(cls, seconds: Rate, tokens: int, rows: int, flops: float, calls: int,
           call: float) -> "ModelFit":
        """From the median: ``seconds = calls x call + 3 flops / rate`` (``flops``: the
        forward's, backward being twice them); the calls' part at most half of it."""
        work = max(seconds.median - calls * call, seconds.median / 2)
        return cls(seconds, tokens, rows, 3 * flops / work)


@dataclass(frozen=True)
class RankProbe:
    """One rank's rates on ``threads`` BLAS threads: ``gemm`` FLOP/s of the model's GEMM shape
    ``shape`` (m, k, n), ``passes`` elements/s of an in-place multiply of ``elements`` elements,
    over ``repeats`` windows each; ``model`` the fit of :func:`probe_model` (None when the
    model is too large to run in a short probe: then FLOPs go at the GEMM rate and a kernel
    call costs ``call``, a call on one token)."""

    gemm: Rate
    call: Rate
    passes: Rate
    model: ModelFit | None
    shape: tuple[int, int, int]
    elements: int
    threads: int
    repeats: int

    @property
    def flops(self) -> float:
        """FLOP/s a FLOP of the time model runs at."""
        return self.model.rate if self.model else self.gemm.median

    @property
    def op_seconds(self) -> float:
        """Seconds a kernel call costs besides its FLOPs."""
        return self.call.median

    def describe(self) -> str:
        m, k, n = self.shape
        head = (f"median of {self.repeats} windows on {self.threads} thread(s): GEMM "
                f"[{m},{k}]@[{k},{n}] {self.gemm.median / 1e9:,.1f} GFLOP/s "
                f"({self.gemm.low / 1e9:,.1f}-{self.gemm.high / 1e9:,.1f}, spread "
                f"{100 * self.gemm.spread:.0f}%), kernel call on one token "
                f"{self.call.median * 1e6:,.1f} us (spread {100 * self.call.spread:.0f}%), "
                f"memory-bound pass {self.passes.median / 1e6:,.0f} M elements/s (spread "
                f"{100 * self.passes.spread:.0f}%)")
        if self.model is None:
            return head + "; the model is too large for the forward/backward probe: FLOPs at the GEMM rate"
        fit = self.model
        return (head + f"; the model's forward+backward (one block, NumPy kernels) on "
                f"{fit.rows} x {fit.tokens} tokens {fit.seconds.median * 1e3:,.2f} ms "
                f"({fit.seconds.low * 1e3:,.2f}-{fit.seconds.high * 1e3:,.2f}, spread "
                f"{100 * fit.seconds.spread:.0f}%): FLOPs at {fit.rate / 1e9:,.1f} GFLOP/s")


def gemm_shape(seq_len: int, hidden: int) -> tuple[int, int, int]:
    """The probe's GEMM ``(m, k, n)``: one sequence through a ``hidden x hidden`` linear,
    capped (:data:`GEMM_MAX_ROWS`, :data:`GEMM_MAX_WIDTH`)."""
    h = max(1, min(hidden, GEMM_MAX_WIDTH))
    return max(1, min(seq_len, GEMM_MAX_ROWS)), h, h


MODEL_PROBE_FLOPS = 2e9
"""The most FLOPs one forward+backward of :func:`probe_model` may take (2 sequences): the
sequences are shortened (down to :data:`MODEL_PROBE_MIN_TOKENS`) to fit, else no model probe."""
MODEL_PROBE_MIN_TOKENS = 16


def probe_model(cfg, threads: int | None, repeats: int, seconds: float, clock,
                call: float, rows: int = 2) -> ModelFit | None:
    """One rank's forward and backward through the model's own code: a stage of one block
    with the embedding, the LM head and the loss, ``cfg``'s model on one process, on the NumPy
    kernels (no JIT compile; the fused Numba kernels are faster, so this errs slow), on ``rows``
    sequences, each kernel call taken to cost ``call`` seconds; None when even :data:`MODEL_PROBE_MIN_TOKENS` tokens exceed
    :data:`MODEL_PROBE_FLOPS` or the model does not build as one block on one process."""
    import dataclasses

    from mpipar.config import Config, ConfigError, ParallelConfig, TrainConfig
    from mpipar.parallel.sequence.cost import attention_context
    from mpipar.parallel.tensor.cost import block_flops, head_flops
    from mpipar.plan.step_time import OPS_BLOCK_BWD, OPS_BLOCK_FWD, OPS_ENDS
    from mpipar.rules import validate
    from mpipar.runtime.peak import windowed_best

    def layout_of(seq: int, rows: int):
        train = TrainConfig(seq_len=seq, global_batch_size=rows, micro_batch_size=rows,
                            dtype=cfg.train.dtype)
        # One block and the head (a multi-token prediction module is a block and the head).
        return validate(Config(dataclasses.replace(cfg.model, layers=1, mtp_depth=0),
                               ParallelConfig(), train), 1)

    def flops(layout) -> float:
        return block_flops(layout, attention_context(layout)) + head_flops(layout)

    try:
        seq = cfg.train.seq_len
        while (seq > MODEL_PROBE_MIN_TOKENS
               and 3 * flops(layout_of(seq, rows)) > MODEL_PROBE_FLOPS):
            seq //= 2
        layout = layout_of(seq, rows)
        if 3 * flops(layout) > MODEL_PROBE_FLOPS:
            return None
        step = _stage_step(layout)
    except ConfigError:     # the model's rules refuse it as one block on one process
        return None
    from mpipar.runtime.peak import blas_threads
    with blas_threads(threads):
        measured = Rate.of(windowed_best(step, repeats, seconds, clock))
    return ModelFit.of(measured, seq, rows, flops(layout),
                       OPS_BLOCK_FWD + OPS_BLOCK_BWD + OPS_ENDS, call)


def _stage_step(layout):
    """A function running one forward and backward of ``layout``'s model (one process) on
    random tokens, accumulating into zeroed gradients."""
    from mpipar import kernels
    from mpipar.model.attention import LocalAttention
    from mpipar.model.llama import LlamaStage
    from mpipar.model.params import init_params
    from mpipar.parallel.placement import PlacementTable
    from mpipar.parallel.tensor.ops import TensorParallel

    from mpipar.runtime.precision import Precision
    m, tr = layout.model, layout.train
    dtype = np.dtype(Precision.named(tr.dtype).master)    # the CPU kernels compute bf16 in it
    k = kernels.get_backend("numpy")
    stage = LlamaStage(cfg=m, kernels=k, layers=range(m.layers), first=True, last=True,
                       tp=TensorParallel(kernels=k, table=PlacementTable(model=m)),
                       attention=LocalAttention(k), recompute="none")
    params = init_params(m, 0, dtype)
    grads = {n: np.zeros_like(v) for n, v in params.items()}
    rng = np.random.default_rng(0)
    shape = (tr.micro_batch_size, tr.seq_len)
    tokens, targets = (rng.integers(0, m.vocab_size, shape) for _ in range(2))
    positions, weight = np.arange(tr.seq_len), np.full(shape, 1.0 / tokens.size, dtype)

    def step() -> None:
        loss, cache = stage.forward(params, tokens, positions, targets)
        stage.backward(params, grads, weight, cache)
    return step


def probe_rank(cfg, threads: int | None = None, repeats: int = 7,
               seconds: float = 0.2) -> RankProbe:
    """The rates of a rank of ``cfg`` (a Config; its dtype, bfloat16 as float32: the CPU
    kernels compute in it) with ``threads`` BLAS threads, each over ``repeats`` windows of
    about ``seconds / repeats``. On one thread the calls are timed in CPU seconds (the load of
    other processes on a shared machine does not lengthen them; the cores' sharing among the
    ranks is :func:`mpipar.runtime.nodes.cpu_peak_share`'s), on more in wall seconds."""
    import time

    from mpipar import kernels
    from mpipar.runtime.nodes import threads_in_use
    from mpipar.runtime.peak import blas_threads, probe_peak, windowed_best

    from mpipar.runtime.precision import Precision
    dtype = Precision.named(cfg.train.dtype).master        # the CPU kernels compute bf16 in it
    seq_len, hidden = cfg.train.seq_len, cfg.model.hidden
    shape = gemm_shape(seq_len, hidden)
    gemm = probe_peak(dtype, threads, repeats, seconds, shape=shape)
    ref = kernels.get_backend("numpy")
    x, w = np.ones((1, 1, hidden), dtype), np.ones(hidden, dtype)
    count = int(np.clip(seq_len * hidden, *PASS_ELEMENTS))
    big, other = np.ones(count, dtype), np.full(count, 0.5, dtype)
    with blas_threads(threads):
        used = threads_in_use()
    clock = time.process_time if used == 1 else time.perf_counter
    call = windowed_best(lambda: ref.rmsnorm_fwd(x, w, 1e-5), repeats, seconds, clock)
    passes = [count / t for t in
              windowed_best(lambda: np.multiply(big, other, out=big), repeats, seconds, clock)]
    call = Rate.of(call)
    model = probe_model(cfg, threads, repeats, 2 * seconds, clock, call.median)
    return RankProbe(Rate(gemm.flops, gemm.low, gemm.high), call, Rate.of(passes), model,
                     shape, count, used, repeats)
