"""Per-step metrics: one JSON object a line in ``RUN_DIR/metrics.jsonl`` (rank 0 writes)."""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpipar.comm import Ledger
    from mpipar.engine import StepResult


class MetricsWriter:
    """Appends step records to ``metrics.jsonl``; a fresh run truncates the file."""

    def __init__(self, run_dir: str, enabled: bool = True, append: bool = False) -> None:
        self.enabled = enabled
        self._fh = None
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            self._fh = open(os.path.join(run_dir, "metrics.jsonl"), "a" if append else "w")

    def write(self, result: "StepResult", ledger: "Ledger") -> None:
        if not self.enabled:
            return
        record = {
            "step": result.step,
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            "tokens_per_s": result.tokens / result.step_time_s,
            "step_time_s": result.step_time_s,
            "tokens": result.tokens,
            "comm_bytes": ledger.bytes_by_group(),
            "comm_seconds": ledger.seconds_by_group(),
        }
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
