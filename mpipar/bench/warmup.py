"""``python -m mpipar.bench warmup [--dtype DTYPE ...] [--backend NAME]``: fill the compiled-kernel
cache ahead of a job (a SLURM prologue, a container build), so that the job's first run loads
its kernels instead of compiling them. Every kernel a training step of each dtype calls is
called once on tiny inputs (:func:`mpipar.kernels.warmup.warm_up`); the cache is
``NUMBA_CACHE_DIR`` if set (point the job at the same directory), else ``kernels/__pycache__``.
Prints and returns the seconds per dtype: a cold cache compiles, a filled one loads.
"""

from __future__ import annotations

import argparse
from typing import Any

from mpipar.bench.harness import Section, print_header

DTYPES = ("float32", "bfloat16", "float64")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", nargs="+", choices=DTYPES, default=["float32"],
                        help="the training dtypes whose kernels to compile (bfloat16 runs the "
                             "float32 kernels)")
    parser.add_argument("--backend", default="auto", choices=("auto", "numba", "numpy", "cupy"),
                        help="the kernel backend (auto: as python -m mpipar.train picks it)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from mpipar.kernels import get_backend, warmup
    from mpipar.runtime.compile_once import cache_dir
    from mpipar.runtime.precision import numpy_dtype

    backend = get_backend(args.backend)
    print_header(f"warmup: the {backend.name} kernels into {cache_dir()}")
    if not warmup.compiles(backend):
        print(f"the {backend.name} backend compiles nothing at run time: nothing to do")
        return {"backend": backend.name, "cache": cache_dir(), "seconds": {}}
    seconds = {}
    for name in args.dtype:
        seconds[name] = warmup.warm_up(backend, numpy_dtype(name))
        print(f"{name:>9}: {seconds[name]:7.1f} s ({', '.join(warmup.compiled_ops(backend))})",
              flush=True)
    return {"backend": backend.name, "cache": cache_dir(), "seconds": seconds}


SECTION = Section("warmup", run, "compile the kernels into the cache ahead of a job "
                  "(NUMBA_CACHE_DIR)", configure)
