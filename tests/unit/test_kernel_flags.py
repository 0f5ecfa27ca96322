"""Every compiled function of kernels/ states its fastmath flags and is cached on disk.

Numba's cache keys a function by its signature, not by the flags it inherited from the caller
that compiled it first: a function without its own ``fastmath`` is compiled with its first
caller's flags, which differ between a process that compiles every kernel and one that loads
some from the cache, so the two compute other bits (the cold-against-warm runs of
tests/e2e/test_compile_cache.py). Read from the source, so no kernel is compiled here."""
from __future__ import annotations

import ast
import pathlib

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "kernels"
JIT = {"njit", "jit"}


def _name(node: ast.AST) -> str:
    return getattr(node, "id", getattr(node, "attr", ""))


def unstated(source: str) -> list[str]:
    """``function: what is missing`` for each compiled function of ``source`` whose decorator
    lacks ``cache=True`` or a ``fastmath`` (an ``@overload``: ``jit_options`` with one)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            call = dec if isinstance(dec, ast.Call) else None
            name = _name(call.func if call else dec)
            keywords = {k.arg: k.value for k in call.keywords} if call else {}
            if name in JIT:
                cache = keywords.get("cache")
                if not (isinstance(cache, ast.Constant) and cache.value is True):
                    out.append(f"{node.name}: cache=True")
                if "fastmath" not in keywords:
                    out.append(f"{node.name}: fastmath")
            elif name == "overload":
                options = keywords.get("jit_options")
                if not (isinstance(options, ast.Dict) and any(
                        isinstance(k, ast.Constant) and k.value == "fastmath"
                        for k in options.keys)):
                    out.append(f"{node.name}: jit_options fastmath")
    return out


def test_every_compiled_kernel_states_its_flags_and_is_cached():
    files = sorted(KERNELS.glob("*.py"))
    assert len(files) > 5
    missing = [f"{p.name}: {m}" for p in files for m in unstated(p.read_text())]
    assert not missing, "\n".join(missing)


def test_the_flag_check_can_fail():
    source = ("@njit(cache=True, fastmath=False)\ndef good(x):\n    return x\n"
              "@njit(fastmath={'contract'})\ndef uncached(x):\n    return x\n"
              "@njit(cache=True)\ndef inherits(x):\n    return x\n"
              "@numba.njit\ndef bare(x):\n    return x\n"
              "@overload(f)\ndef impl(x):\n    return lambda x: x\n")
    assert unstated(source) == ["uncached: cache=True", "inherits: fastmath",
                                "bare: cache=True", "bare: fastmath",
                                "impl: jit_options fastmath"]
