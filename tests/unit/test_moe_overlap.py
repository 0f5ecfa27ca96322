"""The sparse FFN's overlap machinery on one process (the 8-rank bit-identity of the overlapped
and blocking ep exchange: ``tests/mpi/test_moe_overlap.py``): with an exchange whose first
experts' rows are this rank's own and the others' arrive later, forward and backward equal the
all-local exchange bit for bit, the own rows are computed before the wait with a ``test``
after each GEMM, and the weight gradients while the input gradients travel back; and the moe
bench's ep waits read from a trace."""
from __future__ import annotations

import json

import numpy as np

from mpipar.bench.moe import ep_wait
from mpipar.kernels import get_backend
from mpipar.model.llama import LinearGrads
from mpipar.model.moe import LocalExperts, Plan, moe_backward, moe_forward
from mpipar.model.params import init_params
from tests.unit.test_moe import MOE


class Later:
    """A transfer of ``rows`` that arrives at ``wait``; ``log`` records its tests and wait."""

    def __init__(self, rows, log: list, name: str) -> None:
        self.rows, self.log, self.name = rows, log, name

    def test(self) -> bool:
        self.log.append(f"test {self.name}")
        return False

    def wait(self):
        self.log.append(f"wait {self.name}")
        return self.rows


class HalfOwn(LocalExperts):
    """Every expert here, experts ``[0, E/2)`` this rank's own rows, the others' arriving."""

    def __init__(self, num_experts: int) -> None:
        super().__init__(num_experts)
        self.log: list[str] = []

    def plan(self, counts) -> Plan:
        bounds = [0] + np.cumsum(counts).tolist()
        half = len(counts) // 2
        return Plan(bounds, [int(c) if e < half else 0 for e, c in enumerate(counts)])

    def send(self, xs, plan):
        return Later(xs, self.log, "send")

    def send_back(self, ys, plan):
        return Later(ys, self.log, "back")


def _run(exchange):
    k = get_backend("numpy")
    p = init_params(MOE, 3, np.float64)
    h = np.random.default_rng(1).normal(size=(2, 5, MOE.hidden))
    out, saved = moe_forward(k, p, 1, MOE, h, exchange)
    grads = {n: np.zeros_like(a) for n, a in p.items()}
    dy = np.random.default_rng(2).normal(size=out.shape)
    dx = moe_backward(k, 1, dy, saved, exchange, LinearGrads(k, p, grads, None), 0.1)
    return out, dx, grads


def test_own_rows_first_equals_all_local_bitwise():
    exchange = HalfOwn(MOE.moe_experts)
    got, want = _run(exchange), _run(LocalExperts(MOE.moe_experts))
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert all(np.array_equal(got[2][n], want[2][n]) for n in want[2])
    log = exchange.log
    # forward: the own rows' 3 GEMMs per expert (none for the others: empty), each followed by
    # a test, then the wait
    assert log[:log.index("wait send")] == ["test send"] * 3 * MOE.moe_experts
    backward = log[log.index("wait back") + 1:]
    first = backward.index("wait send")
    assert backward[:first] == ["test send"] * 3 * MOE.moe_experts
    # the weight gradients, 2 tests per expert, while the input gradients travel back
    assert backward[first + 1:] == ["test back"] * 2 * MOE.moe_experts + ["wait back"]


def test_ep_wait_reads_the_ep_calls_of_a_trace(tmp_path):
    events = [{"ph": "X", "name": "ialltoallv", "dur": 3e5, "args": {"group": "ep"}},
              {"ph": "X", "name": "alltoall", "dur": 1e5, "args": {"group": "ep"}},
              {"ph": "X", "name": "allreduce", "dur": 9e5, "args": {"group": "sp"}},
              {"ph": "M", "name": "process_name", "args": {"name": "rank 0"}}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert ep_wait(str(path), ranks=2, steps=1) == {"rows": 0.15, "counts": 0.05}
