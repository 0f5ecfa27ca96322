"""Activation dumps under ``mpirun -n 8``: the dumps of several layouts reassemble to the
single-process tensors to 1e-12 in float64."""
from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

from activation_dumps import dumping_rank, reference_tensors
from conftest import check_in_groups
from layouts import layout_name, layout_size, small_config
from mpipar.checkpoint.activations import load_global, step_dir
from mpipar.training import step as trainer


# ------------------------------------------------------------------------- mpirun


LAYOUTS = [dict(tp=2, sp=2, pp=2, sp_split="zigzag"),
           dict(dp=2, tp=2, pp=2),
           dict(dp=2, sp=4, sp_split="zigzag", sp_overlap=True),
           dict(dp=2, sp=2, pp=2, sp_mode="ulysses", schedule="zb-h1"),
           dict(pp=2, virtual_stages=2, schedule="interleaved", dp=2)]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout_name(v) for v in LAYOUTS])
def test_dumps_reassemble_to_the_single_process_activations(world, layout):
    size = layout_size(layout)
    base = world.bcast(tempfile.mkdtemp(prefix="mpipar-act-") if world.rank == 0 else None)

    def check(comm) -> list[str]:
        fails = []
        run_dir = os.path.join(base, str(world.rank // size))
        rank = dumping_rank(small_config("float64", **layout), comm, run_dir, "2")
        for k in range(2):
            trainer.train_step(rank, k)
        comm.Barrier()  # every rank's file is renamed into place
        if comm.rank == 0:
            assert len(os.listdir(step_dir(run_dir, 2))) == size
            assert not os.path.exists(step_dir(run_dir, 1))
            for (i, name), want in reference_tensors(2).items():
                got = load_global(run_dir, 2, i, name)
                err = np.abs(got - want).max()
                if not err <= 1e-12:
                    fails.append(f"layer {i} {name}: max abs err {err:.3g}")
        return fails

    check_in_groups(world, size, check)
