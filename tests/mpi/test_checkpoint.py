"""Checkpoints on 8 ranks in one job: ZeRO-1/3 pieces cut across rows, buckets, units and
vocabulary padding are saved as rectangles, the index presents the global tensors, and a
checkpoint loads into another layout and ZeRO stage (a ZeRO-3 one under ZeRO-0 with TP, and
back) and continues exactly like the one-process run.

Run with ``mpirun -n 8 python -m pytest -q --only-mpi tests/mpi/test_checkpoint.py``."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import rank_failures, shared_tmpdir
from layouts import compare, reference, small_config, token_source
from mpipar.rules import validate

CASES = [(dict(dp=2, tp=2, pp=2, zero=1, bucket_mb=0.003), dict(dp=8)),
         (dict(dp=8, zero=1, bucket_mb=0.002), dict(pp=2, sp=2, tp=2, zero=1)),
         (dict(dp=4, tp=2, zero=3), dict(dp=4, tp=2)),
         (dict(dp=2, tp=2, pp=2), dict(dp=8, zero=3)),
         # tied embeddings: saved from both pipeline ends' copies, loaded onto one stage and onto
         # the two ends of another pipeline
         (dict(model="tied", dp=2, tp=2, pp=2, zero=1, bucket_mb=0.003), dict(dp=4, tp=2)),
         (dict(model="tied", dp=8, zero=1), dict(model="tied", pp=4, dp=2, zero=1)),
         # ZeRO-3 in node shared memory, out to ZeRO-3 gathering with TP and back in
         (dict(dp=8, zero=3, zero_shared="node"), dict(dp=4, tp=2, zero=3)),
         (dict(dp=4, tp=2, zero=3), dict(dp=2, pp=2, tp=2, zero=3, zero_shared="node")),
         # ... and with a copy on each of two declared nodes, out to ZeRO-0 with TP
         (dict(dp=8, zero=3, zero_shared="node", ranks_per_node=4), dict(dp=4, tp=2))]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("before,after", CASES,
                         ids=["zero-tp2-pp2", "zero-dp8", "zero3-to-zero0-tp2", "zero0-to-zero3-dp8",
                              "tied-pp2-to-tp2", "tied-dp8-to-pp4", "zero3-shared-to-tp2",
                              "zero3-tp2-to-shared-pp2", "zero3-node-copies-to-tp2"])
def test_save_and_load_across_layouts(world, before, after):
    from mpipar.checkpoint import reader, tools, writer
    from mpipar.runtime.comm import Group, Ledger
    from mpipar.training.engine import Engine

    model = before.get("model", "llama")
    after = dict(after, model=model)
    with rank_failures(world) as fails, shared_tmpdir(world, "mpipar-ckpt-") as root:
        a = Engine(validate(small_config(**before), 8), world, source=token_source())
        a.train_step(0)
        path = writer.save(a.state, a.run_position(1), root, Group(world, "world", Ledger()))
        params = a.gather_params()
        world.Barrier()
        if world.rank == 0:
            saved = reader.read_tensors(path, "param")
            fails += [f"param {n} differs" for n in params
                      if not np.array_equal(saved[n], params[n])]
            moments = reader.read_tensors(path, "exp_avg_sq")
            fails += [f"exp_avg_sq {n} has a hole" for n, v in moments.items()
                      if np.isnan(v).any() or not (v > 0).any()]
            info = tools.inspect(path)
            if before.get("zero") and len(info["shards"]) != 8:  # ZeRO: every rank owns a slice
                fails.append(f"{len(info['shards'])} shard files, expected 8")
            if before.get("zero") and max(t["sources"] for t in info["tensors"]) < 3:
                fails.append("no tensor is cut into 3 or more rectangles")
            names = [t["name"] for t in info["tensors"]]
            if ("param/lm_head.weight" in names) == (model == "tied"):  # tied: embedding once
                fails.append(f"{model} model's checkpoint tensors: {names}")
        b = Engine(validate(small_config(**after), 8), world, source=token_source())
        if reader.load(b.state, path) != 1:
            fails.append("load did not return step 1")
        r2 = b.train_step(1)
        ref = reference(model=model)
        fails += compare(([ref[0][0], r2.loss], [ref[1][0], r2.grad_norm], b.gather_params()),
                         ref, 1e-10)
        ends = b.groups["pp_ends"]
        if model == "tied" and ends.size > 1:  # the two copies loaded and updated alike
            copies = ends.comm.allgather(b.params["embed_tokens.weight"])
            fails += [] if np.array_equal(*copies) else ["tied copies differ after resume"]
