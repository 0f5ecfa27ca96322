"""Compiling a backend's kernels ahead of the work: `warm_up` calls every op of :data:`OPS` once
on tiny inputs of a dtype, so that a JIT backend (numba) compiles, or loads from its on-disk
cache, every kernel a training step of that dtype calls. The wrappers hand the compiled
kernels C-contiguous arrays of the dtype (float32 for bfloat16) and scalars of fixed types, so
the tiny calls compile the very signatures the full-size calls use.

Under MPI, one rank per node runs it while the others wait, then the others load the kernels
from the cache it filled (`mpipar.runtime.compile_once`); `python -m mpipar.bench warmup` fills
the cache ahead of a job.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from . import Backend, numpy_ref

COMPILED = ("numba",)
"""The backends whose kernels are compiled at run time on the host (and cached on disk)."""


def compiles(backend: Backend) -> bool:
    """Whether any op of ``backend`` is a JIT-compiled host kernel."""
    return any(impl in COMPILED for impl in backend.per_op.values())


def compiled_ops(backend: Backend) -> list[str]:
    """The ops of ``backend`` that are JIT-compiled host kernels, in :data:`OPS` order."""
    return [op for op, impl in backend.per_op.items() if impl in COMPILED]


def _inputs(dtype: Any, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Tiny activations: 2 sequences of 24 tokens, 2 query heads and 1 key/value head of 8,
    width 16, a vocabulary of 12."""
    def a(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(dtype)
    return {"x": a(2, 24, 16), "w": (1 + 0.1 * a(16)), "q": a(2, 24, 2, 8), "k": a(2, 24, 1, 8),
            "v": a(2, 24, 1, 8), "gate": a(2, 24, 16), "logits": a(48, 12),
            "docs": np.repeat(np.array([[0, 0, 1]]), 16, axis=1)[:, :24].repeat(2, axis=0)}


def _attention_backward(kb: Backend, t: dict[str, np.ndarray], rng) -> None:
    """The attention backward kernels, fed the reference forward's out and lse (so that a
    process compiling only these compiles no forward)."""
    q, k, v = t["q"], t["k"], t["v"]
    for docs in (None, t["docs"]):
        out, lse = numpy_ref.attention_fwd(q, k, v, q_docs=docs, k_docs=docs)
        out = np.ascontiguousarray(out)
        kb.attention_bwd(q, k, v, out, lse, out, q_docs=docs, k_docs=docs)


def _attention_forward(kb: Backend, t: dict[str, np.ndarray], rng) -> None:
    for docs in (None, t["docs"]):
        out, lse = kb.attention_fwd(t["q"], t["k"], t["v"], q_docs=docs, k_docs=docs)
        kb.attention_merge(out, lse, out, lse)


def _the_rest(kb: Backend, t: dict[str, np.ndarray], rng) -> None:
    """Norms, RoPE, the gated activations and the cross-entropy."""
    x, w, q = t["x"], t["w"], t["q"]
    y, rstd = kb.rmsnorm_fwd(x, w, 1e-5)
    kb.rmsnorm_bwd(y, x, w, rstd)
    s, y, rstd = kb.add_rmsnorm_fwd(x, y, w, 1e-5)
    kb.add_rmsnorm_bwd(y, y, s, w, rstd)
    cos, sin = kb.rope_cos_sin(np.arange(24), 8, 10000.0, numpy_ref.stat_dtype(x.dtype))
    kb.rope_bwd(kb.rope_fwd(q, cos, sin), cos, sin)
    h = kb.swiglu_fwd(t["gate"], x)
    kb.swiglu_bwd(h, t["gate"], x)
    kb.geglu_bwd(kb.geglu_fwd(t["gate"], x), t["gate"], x)
    targets = rng.integers(0, 12, 48)
    m, total, _ = kb.cross_entropy_stats(t["logits"], targets)
    lse = (m + np.log(total)).astype(m.dtype)
    kb.cross_entropy_bwd(t["logits"], targets, lse, np.ones_like(lse))


PARTS = (_attention_backward, _attention_forward, _the_rest)
"""The ops in parts that compile independently, the costliest first (a cold float32 compile on
the test machine: the attention backward and forward several times the rest together): the
ranks of a node that share the compiling split them (:mod:`mpipar.runtime.compile_once`)."""


def warm_up(backend: Backend, dtype: Any, parts=PARTS) -> float:
    """Call every op of ``backend`` in ``parts`` (all of them by default) once on tiny inputs of
    ``dtype`` (a NumPy dtype or ``ml_dtypes.bfloat16``); returns the seconds it took
    (compiling, or loading from the cache, the JIT kernels on a first call in the process)."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    t = _inputs(dtype, rng)
    for part in parts:
        part(backend, t, rng)
    return time.perf_counter() - t0
