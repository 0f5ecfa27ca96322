"""``python -m mpipar.compare RUN_A RUN_B``: two runs' losses and gradient norms side by side.

What users run to check that a layout change, an upgrade or a precision change did not alter
training (torchtitan's loss_compare, Megatron's golden values):

    python -m mpipar.compare runs/a runs/b                       # exactly equal, or exit 1
    python -m mpipar.compare runs/a runs/b --rtol 1e-10          # float64 layouts
    python -m mpipar.compare runs/fp32 runs/bf16 --rtol 0.01 --metric loss --png cmp.png

Each argument is a run directory (its ``metrics.jsonl``) or a ``metrics.jsonl`` itself. The
steps both runs logged are compared (``--steps A:B`` restricts them, 1-based and inclusive):
per step and metric the two values, the absolute and the relative difference
(``|a - b| / |b|``); then the largest of each. A step passes when ``|a - b| <= atol + rtol *
|b|`` (both 0 by default: bit-identical, as a layout change in float64 or a resume is). Exit
status: 0 every compared step passes; 1 some step does not (the first is named), or one run
logged steps (within ``--steps``) the other did not; 2 a run cannot be read, logs a step twice,
a metric is missing, the runs share no step, or ``--png`` cannot be written (one message, no
traceback). When both runs' ``config.toml`` differ, the settings that differ are listed.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

from mpipar.observe.metrics import read_records

METRICS = ("loss", "grad_norm")


@dataclass(frozen=True)
class Difference:
    """One step's values of one metric in two runs."""

    step: int
    metric: str
    a: float
    b: float

    @property
    def absolute(self) -> float:
        return abs(self.a - self.b)

    @property
    def relative(self) -> float:
        if self.a == self.b:
            return 0.0
        return self.absolute / abs(self.b) if self.b else math.inf

    def within(self, rtol: float, atol: float) -> bool:
        """``|a - b| <= atol + rtol |b|``; NaN matches only NaN (a skipped step in both runs)."""
        if math.isnan(self.a) or math.isnan(self.b):
            return math.isnan(self.a) and math.isnan(self.b)
        return self.absolute <= atol + rtol * abs(self.b)


def load(path: str) -> dict[int, dict[str, Any]]:
    """A run's step records by step (a run directory or its metrics.jsonl); ValueError names the
    file when it cannot be read."""
    file = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
    try:
        records = read_records(file)
    except OSError as exc:
        raise ValueError(f"{file}: cannot be read ({exc.strerror or exc})") from None
    out: dict[int, dict[str, Any]] = {}
    for k, record in enumerate(records):
        if record["step"] in out:
            raise ValueError(f"{file}: step {record['step']} is logged twice (record {k + 1}); "
                             f"a run logs each step once: which one to compare is not known")
        out[record["step"]] = record
    return out


def only_one_side(a: dict[int, dict], b: dict[int, dict],
                  steps: tuple[int, int] | None = None) -> str:
    """Which steps (within ``steps``) only one run logged, as a sentence ('' when none)."""
    def inside(s: int) -> bool:
        return steps is None or steps[0] <= s <= steps[1]
    parts = []
    for name, mine, other in (("run A", a, b), ("run B", b, a)):
        alone = sorted(s for s in mine if s not in other and inside(s))
        if alone:
            shown = ", ".join(map(str, alone[:5])) + (", ..." if len(alone) > 5 else "")
            parts.append(f"{name} logged {len(alone)} step(s) the other did not ({shown})")
    return "; ".join(parts)


def config_differences(path_a: str, path_b: str, limit: int = 8) -> list[str]:
    """The settings in which the two runs' ``config.toml`` differ (``section.field: a vs b``;
    none when either run has no readable config.toml)."""
    import tomllib

    def flat(path: str) -> dict[str, Any] | None:
        root = path if os.path.isdir(path) else os.path.dirname(path) or "."
        try:
            with open(os.path.join(root, "config.toml"), "rb") as fh:
                raw = tomllib.load(fh)
        except (OSError, ValueError, RecursionError):
            return None
        return {f"{section}.{key}": value for section, table in raw.items()
                if isinstance(table, dict) for key, value in table.items()}
    a, b = flat(path_a), flat(path_b)
    if a is None or b is None:
        return []
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    out = [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys[:limit]]
    return out + ([f"... {len(keys) - limit} more"] if len(keys) > limit else [])


def differences(a: dict[int, dict], b: dict[int, dict], metrics: tuple[str, ...],
                steps: tuple[int, int] | None = None) -> list[Difference]:
    """The steps both runs logged (within ``steps``), each metric's two values; ValueError when
    they share no step or a record lacks a metric."""
    common = sorted(set(a) & set(b))
    if steps is not None:
        common = [s for s in common if steps[0] <= s <= steps[1]]
    if not common:
        raise ValueError("the runs share no logged step" + (f" in {steps[0]}:{steps[1]}"
                                                             if steps else ""))
    out = []
    for step in common:
        for metric in metrics:
            values = [run[step].get(metric) for run in (a, b)]
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
                raise ValueError(f"step {step}: {metric} is not a number in both runs "
                                 f"({values[0]!r}, {values[1]!r})")
            out.append(Difference(step, metric, float(values[0]), float(values[1])))
    return out


def report(diffs: list[Difference], rtol: float, atol: float) -> tuple[str, Difference | None]:
    """The side-by-side table, the largest differences, and the first step out of tolerance."""
    lines = [f"{'step':>6}  {'metric':<10} {'run A':>22} {'run B':>22} {'abs diff':>10} "
             f"{'rel diff':>10}"]
    for d in diffs:
        flag = "" if d.within(rtol, atol) else "  <-- beyond tolerance"
        lines.append(f"{d.step:>6}  {d.metric:<10} {d.a!r:>22} {d.b!r:>22} {d.absolute:>10.3g} "
                     f"{d.relative:>10.3g}{flag}")
    for metric in dict.fromkeys(d.metric for d in diffs):
        mine = [d for d in diffs if d.metric == metric]
        worst_abs = max(mine, key=lambda d: d.absolute)
        worst_rel = max(mine, key=lambda d: d.relative)
        lines.append(f"{metric}: largest absolute difference {worst_abs.absolute:.6g} (step "
                     f"{worst_abs.step}), largest relative {worst_rel.relative:.6g} (step "
                     f"{worst_rel.step}) over {len(mine)} steps")
    failed = next((d for d in diffs if not d.within(rtol, atol)), None)
    return "\n".join(lines), failed


def plot(diffs: list[Difference], names: tuple[str, str], path: str) -> None:
    """Each metric of both runs against the step, and their relative difference (needs the
    ``[report]`` extra, matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    metrics = list(dict.fromkeys(d.metric for d in diffs))
    fig, axes = plt.subplots(2, len(metrics), figsize=(6 * len(metrics), 6), squeeze=False)
    for col, metric in enumerate(metrics):
        mine = [d for d in diffs if d.metric == metric]
        steps = [d.step for d in mine]
        axes[0][col].plot(steps, [d.a for d in mine], label=names[0])
        axes[0][col].plot(steps, [d.b for d in mine], "--", label=names[1])
        axes[0][col].set_title(metric)
        axes[0][col].legend()
        axes[1][col].semilogy(steps, [max(d.relative, 1e-17) for d in mine])
        axes[1][col].set_xlabel("step")
        axes[1][col].set_ylabel("relative difference")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _steps(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        return int(lo or 1), int(hi) if hi else 2**62
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps {text!r}: must be A:B (step numbers)") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mpipar.compare",
                                     description="Compare two runs' losses and gradient norms "
                                                 "step by step.")
    parser.add_argument("run_a", help="run directory (or its metrics.jsonl)")
    parser.add_argument("run_b", help="the reference: relative differences are over its values")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0)")
    parser.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
    parser.add_argument("--steps", type=_steps, default=None, metavar="A:B",
                        help="compare steps A..B only (inclusive; either end may be left out)")
    parser.add_argument("--metric", action="append", choices=METRICS,
                        help="compare this metric only (repeatable; default: loss and grad_norm)")
    parser.add_argument("--png", metavar="FILE", help="also plot both runs and their difference")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (args.rtol >= 0 and args.atol >= 0):
        print(f"mpipar.compare: error: --rtol {args.rtol} and --atol {args.atol} must be >= 0",
              file=sys.stderr)
        return 2
    try:
        a, b = load(args.run_a), load(args.run_b)
        diffs = differences(a, b, tuple(dict.fromkeys(args.metric or METRICS)), args.steps)
    except ValueError as exc:
        print(f"mpipar.compare: error: {exc}", file=sys.stderr)
        return 2
    text, failed = report(diffs, args.rtol, args.atol)
    print(text)
    changed = config_differences(args.run_a, args.run_b)
    if changed:
        print("the runs' configurations differ: " + "; ".join(changed))
    if args.png:
        try:
            plot(diffs, (args.run_a, args.run_b), args.png)
        except (OSError, ValueError) as exc:
            print(f"mpipar.compare: error: --png {args.png}: cannot be written "
                  f"({getattr(exc, 'strerror', None) or exc})", file=sys.stderr)
            return 2
    alone = only_one_side(a, b, args.steps)
    if alone:
        print(f"mpipar.compare: {alone}: the runs differ in the steps they logged",
              file=sys.stderr)
        return 1
    if failed is not None:
        print(f"mpipar.compare: step {failed.step}: {failed.metric} {failed.a!r} vs {failed.b!r} "
              f"differs by {failed.absolute:.3g} (relative {failed.relative:.3g}), beyond "
              f"atol {args.atol:g} + rtol {args.rtol:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
