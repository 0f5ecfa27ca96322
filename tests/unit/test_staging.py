"""The device-agnostic parts of the GPU engine, on the host: CUDA-aware MPI detection
on the MPI library really loaded here, the staging path's buffers, the device rules, and the
rank -> GPU map. The multi-rank proof that every layout is unchanged by staging is in
mpi/test_staging.py."""
from __future__ import annotations

import os

import numpy as np
import pytest

from mpipar.runtime import device

from mpipar.runtime import staging
from mpipar.runtime.comm import Ledger
from mpipar.config import Config, ConfigError, TrainConfig
from mpipar.rules import validate

NO_CUDA = device.cuda_unavailable() is not None


def test_detection_asks_the_loaded_library(monkeypatch):
    """The symbol is looked up for real in the libmpi that mpi4py loaded; the MPICH wheel (or
    any MPI built without CUDA) answers "not available"."""
    monkeypatch.delenv(staging.ENV_OVERRIDE, raising=False)
    library = staging.loaded_mpi_library()
    assert library is not None and os.path.basename(library).startswith("libmpi")
    aware, how = staging.cuda_aware_mpi()
    assert library in how and "cuda" in how.lower()
    if NO_CUDA:  # no CUDA here: the library cannot have been asked to use it
        assert aware is False, how
    assert staging.query_cuda_support(library) == (aware, how)


@pytest.mark.parametrize("value,aware", [("1", True), ("on", True), ("0", False), ("NO", False)])
def test_environment_override(monkeypatch, value, aware):
    monkeypatch.setenv(staging.ENV_OVERRIDE, value)
    assert staging.cuda_aware_mpi() == (aware, f"{staging.ENV_OVERRIDE}={value.lower()}")


def test_bad_override_is_a_config_error(monkeypatch):
    monkeypatch.setenv(staging.ENV_OVERRIDE, "maybe")
    with pytest.raises(ConfigError, match="train.cuda_aware_mpi='auto': MPIPAR_CUDA_AWARE_MPI="
                                          "'maybe': must be one of"):
        validate(Config(train=TrainConfig(backend="numpy")), 1)


def _cfg(**train) -> Config:
    return Config(train=TrainConfig(backend="numpy", **train))


@pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is present: the rule accepts")
def test_cuda_without_a_device_is_refused():
    with pytest.raises(ConfigError, match=r"train.device='cuda': no CUDA device here: cupy "):
        validate(_cfg(device="cuda"), 1)
    assert device.resolve_device("auto") == "cpu"
    validate(_cfg(device="auto"), 1)  # auto falls back to the CPU


def test_cuda_aware_on_is_refused_when_the_library_says_no(monkeypatch):
    monkeypatch.setenv(staging.ENV_OVERRIDE, "0")
    with pytest.raises(ConfigError, match=r"train.cuda_aware_mpi='on': the MPI library does not "
                                          r"take CUDA device buffers \(MPIPAR_CUDA_AWARE_MPI=0\)"):
        validate(_cfg(cuda_aware_mpi="on"), 1)
    monkeypatch.setenv(staging.ENV_OVERRIDE, "1")
    validate(_cfg(cuda_aware_mpi="on"), 1)


def test_paths_chosen():
    assert isinstance(staging.choose_path("auto", False), staging.DirectPath)
    assert isinstance(staging.choose_path("on", False), staging.DirectPath)
    forced = staging.choose_path("off", False)
    assert isinstance(forced, staging.StagedPath) and "--cuda-aware-mpi off" in forced.describe()


@pytest.mark.parametrize("local,visible,want", [(0, 1, 0), (7, 1, 0), (5, 4, 1), (3, 8, 3)])
def test_rank_to_gpu(local, visible, want):
    assert device.gpu_for(local, visible) == want


@pytest.mark.parametrize("on_node,visible", [(8, 1), (8, 3), (2, 4), (1, 1), (7, 2)])
def test_ranks_sharing_a_gpu_are_counted_as_placed(on_node, visible):
    """MFU's peak: each rank's share of its GPU is 1 / the ranks gpu_for puts there, so the
    node's ranks together count each used GPU once."""
    placed = [device.gpu_for(local, visible) for local in range(on_node)]
    for index in set(placed):
        assert device.ranks_sharing(index, visible, on_node) == placed.count(index)
    shares = sum(1 / device.ranks_sharing(g, visible, on_node) for g in placed)
    assert shares == pytest.approx(len(set(placed)))


def test_no_visible_gpu_is_an_error():
    with pytest.raises(ValueError, match="visible=0"):
        device.gpu_for(0, 0)


def test_staged_buffers_carry_values_and_are_reused():
    """lease(load) hands MPI a host copy; release(store) writes the buffer back; a buffer
    returns to its pool and the next lease of that dtype and length reuses it."""
    path, ledger = staging.StagedPath(staging.HostCopies(), "test"), Ledger()
    a = np.arange(12.0).reshape(3, 4)
    buf = path.lease(a, ledger, load=True)
    assert buf is not a and buf.shape == (12,) and np.array_equal(buf, a.reshape(-1))
    buf *= 2  # what an in-place reduction over two equal ranks does
    path.release(a, buf, ledger, store=True)
    assert np.array_equal(a, 2 * np.arange(12.0).reshape(3, 4))
    again = path.lease(np.zeros(12), ledger, load=False)
    assert again is buf and path.allocated == 1
    other = path.lease(np.zeros(12, np.float32), ledger, load=True)
    assert other is not buf and path.allocated == 2
    assert ledger.staging.bytes == 2 * a.nbytes + 12 * 4 and ledger.staging.messages == 3


def test_staged_ahead_is_consumed_by_the_call_that_sends():
    path, ledger = staging.StagedPath(staging.HostCopies(), "test"), Ledger()
    a = np.arange(6.0)
    path.ahead(a, ledger)
    assert ledger.staging.bytes == a.nbytes
    buf = path.lease(a, ledger, load=True)  # the copy made ahead, not a second one
    assert np.array_equal(buf, a) and ledger.staging.bytes == a.nbytes
    path.release(a, buf, ledger, store=False)
    assert path.lease(np.empty(6), ledger, load=False) is buf


def test_device_line_on_the_cpu():
    assert device.Device("cpu").describe() == "cpu"
    assert device.Device("cuda", 1, 4).describe() == "cuda:1 of 4 visible"
