"""The compile gate: every CUDA source mpipar ships, compiled through NVRTC as CuPy's RawModule
compiles it, for each target architecture, without a GPU.

    python -m mpipar.kernels.cuda_gate [--arch sm_80,sm_90] [--json FILE] [--jobs N]

prints one line per kernel and architecture (name expression, registers, spill stores and loads,
local stack, static and dynamic shared memory) and exits non-zero on a compile error, any spill
or local stack, static shared memory over 48 KiB, or static + dynamic shared memory over the
architecture's per-block limit. `nvcc` or a host compiler would not do: NVRTC lacks headers
nvcc has (``INFINITY`` once broke every kernel that nvcc accepted).

Sources come from the modules in :data:`MODULES`; each implements ``cuda_sources() ->
list[dict]``, every dict {"name": module label, "code": CUDA source, "names": every name
expression the module instantiates, "options": the extra NVRTC options of its RawModule,
"dynamic_smem": {name expression: dynamic shared bytes it is launched with}}. A module that does
not exist is skipped with a note.

CuPy internals relied on (checked with :data:`TESTED`): ``cupy._core.core.
assemble_cupy_compiler_options`` (CuPy's include directories, CCCL and the CUDA runtime headers
of the ``nvidia-cuda-runtime`` wheel) and ``cupy_backends.cuda.libs.nvrtc`` (createProgram,
addNameExpression, compileProgram, getProgramLog, getLoweredName). After them RawModule adds
``-ftz=true``, ``-arch=sm_XX`` and ``--device-as-default-execution-space`` (CuPy 14.2's
``cupy/cuda/compiler.py``); the gate adds ``-Xptxas=-v``, which only makes ptxas report.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from types import SimpleNamespace
from typing import Any, Sequence

MODULES: tuple[str, ...] = ("mpipar.kernels.cupy_gpu", "mpipar.kernels.flash_mma",
                            "mpipar.kernels.cuda_fused", "mpipar.kernels.cuda_moves")
"""Modules whose ``cuda_sources()`` the gate compiles."""
ARCHS: tuple[str, ...] = ("sm_80", "sm_90")
STATIC_SMEM_LIMIT = 48 * 1024
"""Static ``__shared__`` bytes a block may declare (larger needs dynamic shared memory)."""
_SMEM_OPTIN = {80: 166912, 87: 166912, 90: 232448, 100: 232448, 103: 232448}
"""Shared bytes a block may use with the opt-in (CUDA programming guide, compute capabilities);
other architectures (8.6, 8.9, 12.x) 101376."""
TESTED = {"cupy": ("14.2",), "nvrtc": ((12, 9), (13, 0), (13, 5))}
"""Versions the internals above were checked with (others get a note, not a failure)."""
RAW_MODULE_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")
_SOURCE_KEYS = {"name": str, "code": str, "names": tuple, "options": tuple, "dynamic_smem": dict}


@functools.cache
def runtime_module(module: str) -> Any:
    """The CuPy ``RawModule`` of ``module``'s CUDA source (its one ``cuda_sources()`` entry) as
    the run time uses it: the source's code, options and every name expression, the arguments
    this gate compiles; built once per process on first use (CuPy caches the binary on disk)."""
    import cupy
    (src,) = importlib.import_module(module).cuda_sources()
    return cupy.RawModule(code=src["code"], options=src["options"], name_expressions=src["names"])


class GateUnavailable(RuntimeError):
    """CuPy or NVRTC cannot be imported here: the gate cannot run."""


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """What ptxas reported for one kernel on one architecture (``error``: why it did not
    compile; the numbers are then -1)."""

    module: str
    name: str
    arch: str
    registers: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    stack_bytes: int = -1
    static_smem: int = -1
    dynamic_smem: int = 0
    error: str = ""

    def problems(self) -> list[str]:
        """Why this kernel fails the gate (empty: it passes)."""
        if self.error:
            lines = [ln.strip() for ln in self.error.splitlines() if ln.strip()]
            first = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "?")
            return [f"compile error: {first}"]
        out = []
        if self.spill_stores or self.spill_loads:
            out.append(f"spills {self.spill_stores} B stored, {self.spill_loads} B loaded")
        if self.stack_bytes:
            out.append(f"{self.stack_bytes} B of local stack (per-thread memory in DRAM)")
        if self.static_smem > STATIC_SMEM_LIMIT:
            out.append(f"static shared memory {self.static_smem} B > {STATIC_SMEM_LIMIT} B")
        limit = smem_limit(self.arch)
        if self.static_smem + self.dynamic_smem > limit:
            out.append(f"shared memory {self.static_smem} + {self.dynamic_smem} B > {limit} B "
                       f"on {self.arch}")
        return out


def smem_limit(arch: str) -> int:
    """Shared memory bytes one block may use (static + dynamic, with the opt-in) on ``sm_XX``."""
    return _SMEM_OPTIN.get(int(arch.removeprefix("sm_").rstrip("af")), 101376)


@functools.cache
def toolchain() -> SimpleNamespace:
    """CuPy's option assembly and NVRTC binding, with their versions; raises GateUnavailable
    with what to install where they do not import."""
    try:
        import cupy
        from cupy._core.core import assemble_cupy_compiler_options
        from cupy_backends.cuda.libs import nvrtc
        version = tuple(nvrtc.getVersion())
    except Exception as exc:  # ImportError, a missing libnvrtc, a moved internal
        raise GateUnavailable(
            f"the CUDA compile gate needs CuPy with NVRTC ({type(exc).__name__}: {exc}); "
            "install them with pip install -e '.[cuda-compile]'") from exc
    notes = []
    if not cupy.__version__.startswith(TESTED["cupy"]):
        notes.append(f"CuPy {cupy.__version__} is untested here (tested: {TESTED['cupy']})")
    if version not in TESTED["nvrtc"]:
        notes.append(f"NVRTC {version} is untested here (tested: {TESTED['nvrtc']})")
    return SimpleNamespace(assemble=assemble_cupy_compiler_options, nvrtc=nvrtc, notes=notes,
                           versions={"cupy": cupy.__version__,
                                     "nvrtc": ".".join(map(str, version))})


def nvrtc_options(options: Sequence[str], arch: str) -> tuple[str, ...]:
    """The NVRTC options a RawModule with ``options`` compiles with for ``arch``, plus -v for
    ptxas."""
    return (tuple(toolchain().assemble(tuple(options))) + RAW_MODULE_OPTIONS[:1]
            + (f"-arch={arch}",) + RAW_MODULE_OPTIONS[1:] + ("-Xptxas=-v",))


def check_source(src: dict) -> None:
    """Raise ValueError unless ``src`` follows the cuda_sources protocol."""
    for key, kind in _SOURCE_KEYS.items():
        if not isinstance(src.get(key), kind):
            raise ValueError(f"cuda source {src.get('name', '?')!r}: {key!r} must be a "
                             f"{kind.__name__}, got {type(src.get(key)).__name__}")
    if not src["names"]:
        raise ValueError(f"cuda source {src['name']!r} names no kernel")


def collect_sources(modules: Sequence[str] | None = None) -> tuple[list[dict], list[str]]:
    """(every source of the modules (default :data:`MODULES`), notes on skipped modules).
    A module that exists but fails to import or lacks ``cuda_sources`` raises."""
    sources, notes = [], []
    for name in MODULES if modules is None else modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            notes.append(f"{name}: not present, skipped")
            continue
        for src in module.cuda_sources():
            check_source(src)
            sources.append(src)
    return sources, notes


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """ptxas -v output -> {mangled entry name: registers, spill_stores, spill_loads,
    stack_bytes, static_smem}. Properties of non-inlined device functions are ignored."""
    out: dict[str, dict[str, int]] = {}
    entry, props_of = None, None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry = m.group(1)
            out[entry] = {"registers": -1, "spill_stores": 0, "spill_loads": 0,
                          "stack_bytes": 0, "static_smem": 0}
        elif m := _PROPS.search(line):
            props_of = m.group(1)
        elif (m := _FRAME.search(line)) and entry is not None and props_of == entry:
            out[entry].update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)),
                              spill_loads=int(m.group(3)))
        elif (m := _USED.search(line)) and entry is not None:
            smem = _SMEM.search(line)
            out[entry].update(registers=int(m.group(1)),
                              static_smem=int(smem.group(1)) if smem else 0)
    return out


def compile_source(src: dict, arch: str) -> list[KernelReport]:
    """Compile one source for one architecture: a report per name expression, and one per
    entry function ptxas compiled that no name expression names (nothing escapes the gate)."""
    nvrtc = toolchain().nvrtc
    prog = nvrtc.createProgram(src["code"], src["name"] + ".cu", (), ())
    try:
        for name in src["names"]:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, nvrtc_options(src["options"], arch))
        except nvrtc.NVRTCError as exc:
            log = (nvrtc.getProgramLog(prog) or str(exc)).replace("\x00", "")
            return [KernelReport(src["name"], name, arch, error=log) for name in src["names"]]
        lowered = {nvrtc.getLoweredName(prog, name): name for name in src["names"]}
        stats = parse_ptxas(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)
    reports = []
    for mangled, name in lowered.items():
        if mangled not in stats:
            reports.append(KernelReport(src["name"], name, arch,
                                        error=f"ptxas reported nothing for {mangled}"))
            continue
        reports.append(KernelReport(src["name"], name, arch, **stats[mangled],
                                    dynamic_smem=int(src["dynamic_smem"].get(name, 0))))
    for mangled in sorted(set(stats) - set(lowered)):
        reports.append(KernelReport(src["name"], mangled, arch, **stats[mangled]))
    return reports


def _compile_task(task: tuple[dict, str]) -> list[KernelReport]:
    return compile_source(*task)


def compile_report(arch: str, sources: list[dict] | None = None,
                   jobs: int = 1) -> list[KernelReport]:
    """Reports of every kernel of ``sources`` (default: :func:`collect_sources`) on ``arch``,
    compiled by ``jobs`` processes."""
    return compile_all([arch], sources, jobs)


def compile_all(archs: Sequence[str], sources: list[dict] | None = None,
                jobs: int = 1) -> list[KernelReport]:
    """:func:`compile_report` for several architectures, in (arch, source) order."""
    toolchain()
    sources = collect_sources()[0] if sources is None else sources
    tasks = [(src, arch) for arch in archs for src in sources]
    if jobs > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(min(jobs, len(tasks))) as pool:
            parts = list(pool.map(_compile_task, tasks))
    else:
        parts = [_compile_task(t) for t in tasks]
    return [r for part in parts for r in part]


def format_table(reports: Sequence[KernelReport]) -> str:
    """One line per kernel and architecture, a header first."""
    width = max([len(r.name) for r in reports] + [6])
    lines = [f"{'arch':6} {'kernel':{width}} {'regs':>4} {'spill st/ld':>11} {'stack':>5} "
             f"{'smem':>6} {'dyn':>6}  verdict"]
    for r in reports:
        bad = r.problems()
        lines.append(f"{r.arch:6} {r.name:{width}} {r.registers:4d} "
                     f"{f'{r.spill_stores}/{r.spill_loads}':>11} {r.stack_bytes:5d} "
                     f"{r.static_smem:6d} {r.dynamic_smem:6d}  {'; '.join(bad) or 'ok'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: 0 when every kernel passes, 1 when any fails, 2 without CuPy/NVRTC."""
    parser = argparse.ArgumentParser(prog="python -m mpipar.kernels.cuda_gate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default=",".join(ARCHS),
                        help="comma-separated architectures (default %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write the reports as JSON")
    parser.add_argument("--jobs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                        help="compiler processes (default %(default)s)")
    args = parser.parse_args(argv)
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    if not archs or not all(re.fullmatch(r"sm_\d+[af]?", a) for a in archs):
        parser.error(f"--arch {args.arch!r}: expected names like sm_80,sm_90")
    try:
        tools = toolchain()
    except GateUnavailable as exc:
        print(f"cuda_gate: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    sources, notes = collect_sources()
    reports = compile_all(archs, sources, args.jobs)
    seconds = time.perf_counter() - start
    failed = [r for r in reports if r.problems()]
    print(f"cuda_gate: CuPy {tools.versions['cupy']}, NVRTC {tools.versions['nvrtc']}, "
          f"{len(sources)} sources, {len(reports)} kernels on {','.join(archs)}, {seconds:.1f} s")
    for note in notes + tools.notes:
        print(f"note: {note}")
    print(format_table(reports))
    for module, arch, error in dict.fromkeys((r.module, r.arch, r.error) for r in failed
                                             if r.error):
        print(f"\n{module} ({arch}):\n{error.strip()}")
    print(f"cuda_gate: {'FAIL' if failed else 'ok'}: {len(failed)} of {len(reports)} kernels fail")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"ok": not failed, "seconds": round(seconds, 2), "archs": archs,
                       "versions": tools.versions, "notes": notes + tools.notes,
                       "kernels": [dataclasses.asdict(r) | {"problems": r.problems()}
                                   for r in reports]}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
