"""The training run as users live it, the parts that run in this process: the collective
watchdog's rule, the memory checks against the planner's peak and /dev/shm, ranks per node from
the launcher's environment. The launched runs (the default run, preemption, failures, bad data):
e2e/test_operations.py."""
from __future__ import annotations

import pytest

from launch import TINY


def test_watchdog_names_only_a_call_blocked_too_long():
    import threading

    from mpipar.runtime.comm import Ledger, Watchdog

    ledger = Ledger()
    called = threading.Event()
    messages = []
    dog = Watchdog([Ledger(), ledger], timeout=5.0, rank=0,
                   on_stuck=lambda m: (messages.append(m), called.set()))
    assert dog.stuck() is None
    ledger.begin("tp", "allreduce", 4)
    start = ledger.in_flight[3]
    assert dog.stuck(start + 4.9) is None
    assert dog.stuck(start + 7.25) == (
        "mpipar: rank 0: collective watchdog: allreduce on group 'tp' (size 4) has been blocked "
        "7.2 s, longer than --collective-timeout 5 s; another rank is stuck or gone. Aborting "
        "all ranks")
    ledger.add("tp", "allreduce", 64, 0.1)                  # the call returned
    assert ledger.in_flight is None and dog.stuck(start + 100) is None
    with pytest.raises(ValueError, match="must be > 0 seconds"):
        Watchdog([ledger], 0.0, rank=0, on_stuck=print)
    # The thread calls on_stuck once with the message, then ends.
    fast = Watchdog([ledger], timeout=0.05, rank=3, on_stuck=lambda m: (messages.append(m),
                                                                       called.set())).start()
    ledger.begin("pp", "recv", 2)
    assert called.wait(timeout=30)
    fast._thread.join(timeout=30)
    assert not fast._thread.is_alive()
    assert len(messages) == 1 and messages[0].startswith(
        "mpipar: rank 3: collective watchdog: recv on group 'pp' (size 2) has been blocked")
    # Start-up (until step 1 has finished) is allowed --startup-timeout instead, if longer.
    slow = Watchdog([ledger], timeout=5.0, rank=0, on_stuck=print, startup=60.0)
    start = ledger.in_flight[3]
    assert slow.stuck(start + 59) is None
    assert "longer than --startup-timeout 60 s (start-up and step 1)" in slow.stuck(start + 61)
    slow.steady()
    assert "longer than --collective-timeout 5 s;" in slow.stuck(start + 6)
    assert Watchdog([ledger], 5.0, 0, print, startup=1.0).stuck(start + 6) is not None


def test_the_memory_check_compares_the_planners_peak_with_a_share_of_the_node(monkeypatch):
    """The check in process: the predicted peak of rank 0 against what the node has divided
    among its ranks; --allow-oversubscribed-memory skips it; the lower bound used for absurd
    sizes is the analytic parameter count (equal to the per-tensor sum)."""
    import math

    from mpipar.runtime import host_memory, nodes
    from mpipar.config import ConfigError, ModelConfig
    from mpipar.layout import resolve_model
    from mpipar.model.params import param_specs
    from mpipar.plan.memory import parameter_count, predict_peak_memory
    from mpipar.runtime.topology import Coord
    from mpipar.plan.admission import check_memory
    from mpipar.train import resolve_config

    for model in (ModelConfig(), ModelConfig(vocab_size=97, hidden=48, layers=3, heads=6,
                                             kv_heads=2, head_dim=10, ffn_hidden=80)):
        assert parameter_count(model) == sum(math.prod(s.shape)
                                             for s in param_specs(resolve_model(model)))
    cfg = resolve_config([*TINY, "--tp", "2"], 2)
    need = predict_peak_memory(cfg, Coord(dp=0, tp=0, pp=0, sp=0))
    monkeypatch.setattr(host_memory, "available_memory_bytes", lambda: 4 * need - 4)
    check_memory(cfg, 0, on_node=3)                 # 1.33 x the need each: fits
    with pytest.raises(ConfigError) as err:
        check_memory(cfg, 0, on_node=4)             # just short
    assert str(err.value).startswith(f"rank 0 needs about {need:,} bytes")
    assert f"this node has {4 * need - 4:,} bytes available for 4 rank(s), {need - 1:,} each" \
        in str(err.value)
    cfg.train.allow_oversubscribed_memory = True
    check_memory(cfg, 0, on_node=4)


def test_the_shared_memory_check_applies_to_node_shared_zero3_only(monkeypatch):
    """In process: the node's ranks' parts of its copy of the weights against /dev/shm's free
    bytes, only where ZeRO-3 keeps them in node shared memory (not when gathering)."""
    from mpipar.runtime import host_memory, nodes
    from mpipar.config import ConfigError
    from mpipar.plan.memory import memory_lower_bound
    from mpipar.plan.admission import check_shared_memory
    from mpipar.train import resolve_config

    cfg = resolve_config([*TINY, "--zero", "3", "--zero-shared", "node"], 4)
    need = memory_lower_bound(cfg) // 2 // 4     # one rank's share of the weights
    monkeypatch.setattr(host_memory, "shared_memory_bytes", lambda: 4 * need)
    check_shared_memory(cfg, 0, on_node=4)
    with pytest.raises(ConfigError, match=f"hold at least {5 * need:,} bytes"):
        check_shared_memory(cfg, 0, on_node=5)
    check_shared_memory(resolve_config([*TINY, "--zero", "3"], 4), 0, on_node=5)   # gathered
    # declared nodes of 2 ranks: each node holds a copy, each rank half of it
    two = resolve_config([*TINY, "--zero", "3", "--zero-shared", "node", "--ranks-per-node",
                          "2"], 4)
    check_shared_memory(two, 0, on_node=2)
    with pytest.raises(ConfigError, match=f"hold at least {memory_lower_bound(two) // 4 * 3:,}"):
        check_shared_memory(two, 0, on_node=3)


@pytest.mark.parametrize("env,expected", [
    ({"MPI_LOCALNRANKS": "8"}, 8),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 4),
    ({"SLURM_PROCID": "5", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2),3"}, 4),
    ({"SLURM_PROCID": "9", "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "4(x2),3"}, 3),
    # mpirun's ranks inherit its one-task srun step: the MPI launcher's count wins.
    ({"MPI_LOCALNRANKS": "8", "SLURM_PROCID": "0", "SLURM_NODEID": "0",
      "SLURM_STEP_TASKS_PER_NODE": "1"}, 8),
    ({"SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "garbage"}, None),
    ({}, None),
])
def test_ranks_per_node_from_launcher_environment(monkeypatch, env, expected):
    from mpipar.runtime import nodes

    for var in nodes.LOCAL_SIZE_VARS + ("SLURM_PROCID", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert nodes.local_size_from_env() == expected
