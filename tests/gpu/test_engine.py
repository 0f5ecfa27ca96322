"""The engine on a CUDA device: every layout of up to 8
ranks sharing the GPU equals the CPU's single-process run in float64 (<= 1e-10) through both
MPI paths (staged through pinned buffers; device buffers where the MPI is CUDA-aware), and a
checkpoint written by a GPU run resumes on the CPU, and the other way round, exactly."""
from __future__ import annotations

import dataclasses

import pytest

from conftest import assert_all_ranks
from layouts import compare, layout_name, layout_size, reference, small_config, token_source
from mpipar.runtime.staging import cuda_aware_mpi
from mpipar.rules import validate

LAYOUTS = [dict(), dict(dp=2, tp=2, pp=2, zero=1, bucket_mb=0.002),
           dict(sp=4, tp=2, sp_overlap=True, sp_split="zigzag"),
           dict(dp=2, sp=2, pp=2, sp_mode="ulysses", schedule="interleaved", virtual_stages=2),
           dict(tp=2, pp=2, dp=2, tp_sequence_parallel=True, schedule="zb-h1"),
           # ZeRO-2/3 with device buffers: gathered units and reduce-scatters
           dict(dp=2, tp=2, pp=2, zero=3, zero_prefetch=2), dict(dp=4, sp=2, zero=2),
           dict(dp=2, sp=2, pp=2, zero=3, schedule="interleaved", virtual_stages=2)]
PATHS = ["off", "on"]


def _cfg(layout: dict, device: str, path: str = "auto"):
    cfg = small_config(**layout)
    backend = "cupy" if device == "cuda" else "numpy"
    return dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, device=device, backend=backend, cuda_aware_mpi=path))


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout_name(v) or "single" for v in LAYOUTS])
def test_device_layouts_equal_the_cpu(world, layout, path):
    if path == "on" and not cuda_aware_mpi()[0]:
        pytest.skip(f"MPI is not CUDA-aware here: {cuda_aware_mpi()[1]}")
    from mpipar.training.engine import Engine
    size = layout_size(layout)
    comm = world.Split(world.rank // size, world.rank)
    fails: list[str] = []
    try:
        eng = Engine(validate(_cfg(layout, "cuda", path), size), comm, source=token_source())
        held = (list(eng.params.values()) if eng.sharded is None   # ZeRO-3 binds units on use
                else [values for *_, values in eng.sharded.param_pieces()])
        if not held or any(type(a).__module__.split(".")[0] != "cupy" for a in held):
            fails.append("parameters are not CuPy arrays")
        results = [eng.train_step(k) for k in range(2)]
        got = ([r.loss for r in results], [r.grad_norm for r in results], eng.gather_params())
        fails += compare(got, reference("float64"), 1e-10)
    except Exception as exc:  # every rank must reach the allgather
        fails.append(f"{type(exc).__name__}: {exc}")
    finally:
        comm.Free()
    assert_all_ranks(world, fails)


@pytest.mark.parametrize("first,second", [("cuda", "cpu"), ("cpu", "cuda")])
def test_checkpoint_crosses_devices(tmp_path, first, second):
    """Two steps on ``first``, a checkpoint, then two more on ``second``, equal to four steps on
    the CPU in float64."""
    from mpi4py import MPI
    from mpipar.checkpoint import reader, writer
    from mpipar.runtime.comm import Group, Ledger
    from mpipar.training.engine import Engine
    comm = MPI.COMM_SELF
    cfg = _cfg({}, first)  # steps=2 sets the LR schedule, as in the 4-step reference
    a = Engine(validate(cfg, 1), comm, source=token_source())
    for k in range(2):
        a.train_step(k)
    path = writer.save(a.state, a.run_position(2), tmp_path, Group(comm, "world", Ledger()))
    cfg2 = _cfg({}, second)
    b = Engine(validate(cfg2, 1), comm, source=token_source())
    assert reader.load(b.state, path) == 2
    results = [b.train_step(k) for k in (2, 3)]
    ref_losses, ref_norms, ref_params = reference("float64", steps=4)
    got = ([r.loss for r in results], [r.grad_norm for r in results], b.gather_params())
    assert compare(got, (ref_losses[2:], ref_norms[2:], ref_params), 1e-12) == []
