"""The tree keeps the shape docs/architecture.md gives it: the package's imports follow the
layer order written there (no import from a lower layer to a higher one, no cycle), at most ten
modules sit directly in mpipar/, no module is over 800 lines and no function over 80, and only
the Layout's module resolves a configuration. A configuration mode is compared with a string only
in its home (elsewhere the code asks its object), no class is over 250 lines or 15 attributes,
kernel code (CUDA source, CuPy's kernel classes, Numba's kernels) sits in kernels/ alone,
README.md stays a front door of at most 350 lines with a table of contents, and
docs/benchmarks.md opens with its table of figures within 600 lines."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mpipar"
KERNELS = ROOT / "kernels"
DOC = ROOT / "docs" / "architecture.md"


def module_files() -> dict[str, Path]:
    """Every module of the installed package, by dotted name (kernels/ is mpipar.kernels)."""
    out = {}
    for base, prefix in ((PACKAGE, "mpipar"), (KERNELS, "mpipar.kernels")):
        for path in sorted(base.rglob("*.py")):
            if base == PACKAGE and "kernels" in path.relative_to(base).parts[:1]:
                continue
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([prefix, *parts])] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The mpipar modules ``name`` imports anywhere in its file (function-level imports too)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import mod`` imports the module; ``from pkg import name`` the package.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("mpipar"):
                found.add(target)
    return found


def documented_layers() -> list[list[str]]:
    """The layer order of docs/architecture.md: the lines of its ```layers block, lowest first,
    each naming the modules or packages of one layer."""
    block = re.search(r"```layers\n(.*?)```", DOC.read_text(), re.S)
    assert block, "docs/architecture.md has no ```layers block"
    layers = []
    for line in block.group(1).splitlines():
        names = line.split("#")[0].split()
        if names:
            layers.append(names)
    return layers


def layer_of(module: str, layers: list[list[str]]) -> int:
    """The index of the layer holding ``module`` (the longest matching prefix wins)."""
    best, where = "", -1
    for i, names in enumerate(layers):
        for n in names:
            full = "mpipar" if n == "mpipar" else f"mpipar.{n}"
            if (module == full or module.startswith(full + ".")) and len(full) > len(best):
                best, where = full, i
    return where


def test_imports_follow_the_documented_layers():
    files = module_files()
    known = set(files)
    layers = documented_layers()
    unplaced = sorted(m for m in files if layer_of(m, layers) < 0 and m != "mpipar")
    assert not unplaced, f"modules in no layer of docs/architecture.md: {unplaced}"
    upward = []
    for name, path in files.items():
        mine = layer_of(name, layers)
        for target in imports_of(name, path, known):
            theirs = layer_of(target, layers)
            if target != "mpipar" and theirs > mine:
                upward.append(f"{name} (layer {mine}) imports {target} (layer {theirs})")
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    files = module_files()
    known = set(files)
    graph = {n: imports_of(n, p, known) - {"mpipar"} for n, p in files.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_layer_test_can_fail():
    """A module of a low layer importing a high one is caught (the check is not vacuous)."""
    layers = documented_layers()
    assert layer_of("mpipar.config", layers) < layer_of("mpipar.training.step", layers)
    assert layer_of("mpipar.kernels.numpy_ref", layers) == 0


def test_sizes():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 10, f"{len(top)} modules directly in mpipar/: {top}"
    big, long = [], []
    for name, path in module_files().items():
        text = path.read_text()
        if len(text.splitlines()) > 800:
            big.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert not big and not long, "\n".join(big + long)


@pytest.mark.parametrize("pattern", [r"\.resolved\(",
                                     r"\bimport mpipar\.training\.(rank|step|batches)\b"])
def test_one_place_resolves(pattern):
    """No ``.resolved()`` anywhere (the Layout's module resolves, by functions), and nothing
    imports the training modules for a side effect."""
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in [*PACKAGE.rglob("*.py"), *KERNELS.rglob("*.py"),
                                                    *(ROOT / "tests").rglob("*.py")]
            if p.name != "test_architecture.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(pattern, line)]
    assert not hits, hits


def test_every_package_is_installed():
    """A non-editable install carries every package: setup.cfg lists each folder of mpipar/
    that holds modules (kernels/ is installed as mpipar.kernels)."""
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    found = {".".join(p.relative_to(ROOT).parts) for p in PACKAGE.rglob("*")
             if p.is_dir() and (p / "__init__.py").exists()} | {"mpipar", "mpipar.kernels"}
    assert listed == found, f"setup.cfg lists {sorted(listed - found)} too many, " \
                            f"{sorted(found - listed)} missing"


# ------------------------------------------------------------------------- modes are objects
MODE_HOMES: dict[str, tuple[str, ...]] = {
    "recompute": ("mpipar.model.recompute",),
    "rope_type": ("mpipar.model.rope",),
    "moe_router": ("mpipar.model.router",),
    "sp_mode": ("mpipar.parallel.sequence",),
    "schedule": ("mpipar.parallel.pipeline",),
    "backend": ("mpipar.runtime.device",),
    "attention_backend": ("mpipar.runtime.device",),
    "cpu_bf16_gemm": ("mpipar.runtime.device",),
    "cuda_aware_mpi": ("mpipar.runtime.device",),
    "reduce_dtype": ("mpipar.parallel.data_parallel",),
    "on_nan": ("mpipar.training.loop",),
    "on_rank_failure": ("mpipar.training.recovery",),
    "decay_shape": ("mpipar.training.optim",),
    "optimizer": ("mpipar.training.optimizers",),
    "muon_adjust_lr": ("mpipar.training.muon",),
    "device": ("mpipar.runtime.device",),
    "dtype": ("mpipar.runtime.precision",),
    "sp_split": ("mpipar.parallel.sequence",),
    "lr_schedule": ("mpipar.training.optim",),
    "dp_reduce": ("mpipar.parallel.data_parallel",),
    "grad_compression": ("mpipar.parallel.data_parallel",),
    "error_feedback": ("mpipar.parallel.data_parallel",),
    "topk_catch_up": ("mpipar.parallel.data_parallel",),
    "allreduce_algorithm": ("mpipar.runtime.allreduce", "mpipar.runtime.allreduce_modes"),
    "zero_shared": ("mpipar.parallel.fsdp",),
}
"""Each configuration mode field and the modules that may compare it with a string (its home):
everywhere else the code asks the mode's object. Add a field here when it becomes an object."""

DISSOLVING: tuple[str, ...] = ()
"""Modules being taken apart, exempt from the mode and class-size checks until they are gone."""


def within(module: str, homes: tuple[str, ...]) -> bool:
    """Whether ``module`` is one of ``homes`` or inside one of them (a home may be a package)."""
    return any(module == h or module.startswith(h + ".") for h in homes)


def mode_checked_modules() -> dict[str, Path]:
    """The modules the mode checks read: mpipar's own (a kernel compares its arguments, not the
    configuration's fields), without those being taken apart."""
    return {name: path for name, path in module_files().items()
            if not name.startswith("mpipar.kernels") and name not in DISSOLVING}


def _literal(node: ast.AST) -> bool:
    """A string constant, or a tuple, list or set of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and bool(node.elts) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)


def mode_comparisons(tree: ast.AST, fields: set[str]) -> list[tuple[str, int]]:
    """``(field, line)`` of each place ``tree`` compares ``<expr>.field`` with a string literal
    (``==``, ``!=``, ``in``, ``not in``) or looks it up in a dict literal keyed by strings."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_literal(s) for s in sides):
                found += [(s.attr, node.lineno) for s in sides
                          if isinstance(s, ast.Attribute) and s.attr in fields]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "get" and isinstance(node.func.value, ast.Dict)
              and node.func.value.keys and all(_literal(k) for k in node.func.value.keys if k)
              and node.args and isinstance(node.args[0], ast.Attribute)
              and node.args[0].attr in fields):
            found.append((node.args[0].attr, node.lineno))
    return found


def test_mode_tables_are_consistent():
    """Every field named is a configuration field with a fixed set of choices, named once."""
    import dataclasses

    from mpipar.config import ModelConfig, ParallelConfig, TrainConfig
    choices = {f.name for c in (ModelConfig, ParallelConfig, TrainConfig)
               for f in dataclasses.fields(c) if f.metadata.get("choices")}
    named = list(MODE_HOMES)
    assert set(named) <= choices, sorted(set(named) - choices)
    assert len(set(named)) == len(named), named


@pytest.mark.parametrize("field", sorted(MODE_HOMES))
def test_modes_are_compared_only_in_their_home(field):
    homes = MODE_HOMES[field]
    files = module_files()
    missing = [h for h in homes if h not in files]
    assert not missing, f"{field}: its home {missing} is no module; update MODE_HOMES"
    hits = [f"{name}:{line} compares {field} with a string"
            for name, path in mode_checked_modules().items() if not within(name, homes)
            for _, line in mode_comparisons(ast.parse(path.read_text()), {field})]
    assert not hits, "\n".join(hits)


def test_the_mode_check_can_fail():
    tree = ast.parse('if tr.recompute == "full" or p.sp_mode in ("ring", "zigzag"):\n'
                     '    redo = {"full": 1.0}.get(t.recompute, 0.0)\n')
    assert sorted(mode_comparisons(tree, {"recompute", "sp_mode"})) == [
        ("recompute", 1), ("recompute", 2), ("sp_mode", 1)]


# ---------------------------------------------------------------------------- class sizes
MAX_CLASS_LINES, MAX_CLASS_ATTRIBUTES = 250, 15
OVERSIZED_CLASSES: set[str] = set()
"""Classes allowed over the limits while they are split (``module.Class``): none."""


def class_sizes(tree: ast.AST) -> list[tuple[str, int, int]]:
    """``(name, lines, instance attributes)`` of each class in ``tree``: its attributes are
    the distinct names ``x`` its methods assign as ``self.x``."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        attributes = set()
        for stmt in ast.walk(node):
            if isinstance(stmt, ast.Assign):
                targets = stmt.targets
            elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
                targets = [stmt.target]
            else:
                continue
            attributes |= {t.attr for target in targets for t in ast.walk(target)
                           if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                           and t.value.id == "self"}
        out.append((node.name, node.end_lineno - node.lineno + 1, len(attributes)))
    return out


def test_class_sizes():
    big = [f"{name}.{cls}: {lines} lines, {attrs} attributes"
           for name, path in module_files().items() if name not in DISSOLVING
           for cls, lines, attrs in class_sizes(ast.parse(path.read_text()))
           if (lines > MAX_CLASS_LINES or attrs > MAX_CLASS_ATTRIBUTES)
           and f"{name}.{cls}" not in OVERSIZED_CLASSES]
    assert not big, "\n".join(big)


def test_the_class_check_can_fail():
    body = "".join(f"        self.a{i} = {i}\n" for i in range(16))
    assert class_sizes(ast.parse(f"class A:\n    def __init__(self):\n{body}")) == [("A", 18, 16)]


# ---------------------------------------------------------------------- kernel code's home
KERNEL_API = {"RawKernel", "RawModule", "ElementwiseKernel", "ReductionKernel"}
NUMBA_KERNELS = {"njit", "jit", "vectorize", "guvectorize", "stencil"}
KERNELS_ELSEWHERE: set[str] = set()
"""Modules of mpipar/ allowed to hold kernel code: none (kernel code lives in kernels/)."""


def kernel_code(tree: ast.AST) -> list[tuple[str, int]]:
    """``(what, line)`` of each piece of kernel code in ``tree``: CUDA source in a string,
    CuPy's kernel classes, Numba's kernel decorators and compilers."""
    numba = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for a in node.names if a.name == "numba"}
    from_numba = {a.asname or a.name for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("numba")
                  for a in node.names if a.name in NUMBA_KERNELS}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                "__global__" in node.value or 'extern "C"' in node.value):
            found.append(("CUDA source", node.lineno))
        elif isinstance(node, ast.Attribute) and (
                node.attr in KERNEL_API or (node.attr in NUMBA_KERNELS
                                            and isinstance(node.value, ast.Name)
                                            and node.value.id in numba)):
            found.append((node.attr, node.lineno))
        elif isinstance(node, ast.Name) and (node.id in KERNEL_API or node.id in from_numba):
            found.append((node.id, node.lineno))
        elif isinstance(node, ast.ImportFrom) and any(a.name in KERNEL_API for a in node.names):
            found.append(("import of a CuPy kernel class", node.lineno))
    return found


def test_kernel_code_lives_in_kernels():
    hits = [f"{name}:{line}: {what}" for name, path in module_files().items()
            if not name.startswith("mpipar.kernels") and name not in KERNELS_ELSEWHERE
            for what, line in kernel_code(ast.parse(path.read_text()))]
    assert not hits, "\n".join(hits)


def test_the_kernel_check_can_fail():
    source = ('import numba as nb\nfrom numba import njit as fast\nimport cupy\n'
              '@nb.njit\ndef f(x):\n    return x\n@fast\ndef g(x):\n    return x\n'
              'k = cupy.RawKernel(r\'extern "C" __global__ void k() {}\', "k")\n')
    assert sorted(kernel_code(ast.parse(source))) == [
        ("CUDA source", 10), ("RawKernel", 10), ("fast", 7), ("njit", 4)]


# ----------------------------------------------------------------------------- the documents
README_LINES = 350
BENCHMARKS_LINES = 600


def readme_problems(text: str) -> list[str]:
    """Why README.md is no front door: over :data:`README_LINES` lines, or no table of contents
    (a ``## Contents`` list linking to every other ``##`` section)."""
    lines = text.splitlines()
    problems = [f"{len(lines)} lines, over {README_LINES}"] if len(lines) > README_LINES else []
    sections = [ln[3:].strip() for ln in lines if ln.startswith("## ")]
    if "Contents" not in sections:
        return problems + ["no ## Contents"]
    contents = text.split("## Contents", 1)[1].split("\n## ")[0]
    listed = set(re.findall(r"^- \[([^\]]+)\]\(#", contents, re.M))
    missing = [s for s in sections if s != "Contents" and s not in listed]
    return problems + [f"## {s} is not in the contents" for s in missing]


def benchmarks_problems(text: str) -> list[str]:
    """Why docs/benchmarks.md does not answer "how fast is it?" first: over
    :data:`BENCHMARKS_LINES` lines, or no table of figures (topic, figure, method, command)
    before its first section."""
    lines = text.splitlines()
    problems = ([f"{len(lines)} lines, over {BENCHMARKS_LINES}"]
                if len(lines) > BENCHMARKS_LINES else [])
    head = text.split("\n## ", 1)[0]
    if not re.search(r"^\| topic \| figure \| method \| reproduce \|$", head, re.M):
        problems.append("no headline table (| topic | figure | method | reproduce |) before "
                        "the first section")
    return problems


def test_readme_is_a_front_door():
    """README.md: at most :data:`README_LINES` lines with a table of contents; the reference
    lives in docs/."""
    assert not readme_problems((ROOT / "README.md").read_text())


def test_benchmarks_open_with_the_headline_table():
    assert not benchmarks_problems((ROOT / "docs" / "benchmarks.md").read_text())


def test_the_document_checks_can_fail():
    good = "# x\n\n## Contents\n\n- [Install](#install)\n\n## Install\n"
    assert readme_problems(good) == []
    assert readme_problems(good + "## Reference\n") == ["## Reference is not in the contents"]
    assert readme_problems(good.replace("## Contents", "## Index")) == ["no ## Contents"]
    assert readme_problems(good + "line\n" * README_LINES)[0].endswith(f"over {README_LINES}")
    table = "# B\n\n| topic | figure | method | reproduce |\n|---|---|---|---|\n\n## CPU\n"
    assert benchmarks_problems(table) == []
    assert len(benchmarks_problems("# B\n\n## CPU\n" + table)) == 1
    assert benchmarks_problems(table + "x\n" * BENCHMARKS_LINES)[0].endswith(
        f"over {BENCHMARKS_LINES}")
