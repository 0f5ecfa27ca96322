"""The device memory check (``plan.admission.check_device_memory``) without a device: the planner's bytes
of a rank against the free memory of its GPU shared by the node's ranks dealt to it."""
from __future__ import annotations

import pytest

from layouts import small_config
from mpipar.config import ConfigError
from mpipar.layout import vary
from mpipar.plan.memory import predict_memory
from mpipar.rules import validate
from mpipar.runtime.topology import rank_coord
from mpipar.plan.admission import check_device_memory


def _cuda_layout():
    """The test model on 8 ranks (dp 8), its device set to cuda without asking for one."""
    return vary(validate(small_config(dp=8), 8), train={"device": "cuda"})


def test_the_free_memory_of_a_gpu_is_shared_by_the_ranks_dealt_to_it():
    layout = _cuda_layout()
    need = predict_memory(layout, rank_coord(3, 8, 1, 1, 1)).total
    check_device_memory(layout, 3, 8, free=(8 * need, 1))              # 8 ranks on one GPU: fits
    check_device_memory(layout, 3, 8, free=(need, 8))                  # one GPU each: fits
    with pytest.raises(ConfigError, match=rf"rank 3 needs about {need:,} bytes.*for 8 rank"):
        check_device_memory(layout, 3, 8, free=(8 * need - 8, 1))      # a byte short each
    with pytest.raises(ConfigError, match="for 2 rank"):
        check_device_memory(layout, 3, 8, free=(need, 4))              # 2 ranks a GPU


def test_the_check_is_for_cuda_runs_and_can_be_waived():
    layout = _cuda_layout()
    check_device_memory(vary(layout, train={"device": "cpu"}), 0, 8, free=(0, 1))
    check_device_memory(vary(layout, train={"allow_oversubscribed_memory": True}), 0, 8,
                        free=(0, 1))
    with pytest.raises(ConfigError):
        check_device_memory(layout, 0, 8, free=(0, 1))
