"""The tree keeps the shape docs/architecture.md gives it: the package's imports follow the
layer order written there (no import from a lower layer to a higher one, no cycle), at most ten
modules sit directly in mpipar/, no module is over 800 lines and no function over 80, and only
the Layout's module resolves a configuration."""
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


KERNEL_CODE = re.compile(r"RawKernel|RawModule|ElementwiseKernel|ReductionKernel|__global__|"
                         r"extern \"C\"|@(nb|numba)\.|\bnjit\b|@(guvectorize|vectorize)\b")
"""What kernel code looks like: CUDA source, CuPy's compiled kernels, Numba's compiled functions."""


def kernel_code_outside_kernels(package: Path) -> list[str]:
    """``file:line`` of every line of kernel code in ``package``'s modules outside kernels/."""
    return [f"{p.relative_to(package.parent)}:{i}" for p in sorted(package.rglob("*.py"))
            if "kernels" not in p.relative_to(package).parts[:1]
            for i, line in enumerate(p.read_text().splitlines(), 1) if KERNEL_CODE.search(line)]


def test_kernel_code_lives_in_kernels():
    """CUDA source, CuPy kernels and Numba functions sit in kernels/, reached through its
    registry (:func:`mpipar.kernels.get_backend` and the dispatcher's functions)."""
    hits = kernel_code_outside_kernels(PACKAGE)
    assert not hits, hits


def test_the_kernel_code_check_can_fail(tmp_path):
    """A fused kernel written in a training module is caught (the check is not vacuous)."""
    (tmp_path / "mpipar" / "training").mkdir(parents=True)
    (tmp_path / "mpipar" / "kernels").mkdir()
    (tmp_path / "mpipar" / "training" / "optim.py").write_text(
        "import cupy\n\nADAMW = cupy.ElementwiseKernel('T g', 'T p', 'p = p - g', 'adamw')\n")
    (tmp_path / "mpipar" / "training" / "loop.py").write_text(
        "from numba import njit\n\n\n@njit\ndef add(a, b):\n    return a + b\n")
    (tmp_path / "mpipar" / "kernels" / "cuda.py").write_text(
        'SOURCE = r"""extern "C" __global__ void k(float* y) { y[0] = 1.0f; }"""\n')
    assert kernel_code_outside_kernels(tmp_path / "mpipar") == [
        "mpipar/training/loop.py:1", "mpipar/training/loop.py:4", "mpipar/training/optim.py:3"]
