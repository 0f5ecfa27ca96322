"""Checkpoints on 8 ranks in one job: ZeRO-1/3 pieces cut across rows, buckets, units and
vocabulary padding are saved as rectangles, the index presents the global tensors, and a
checkpoint loads into another layout and ZeRO stage (a ZeRO-3 one under ZeRO-0 with TP, and
back) and continues exactly like the one-process run.

Run with ``mpirun -n 8 python -m pytest -q --only-mpi tests/mpi/test_checkpoint.py``."""
from __future__ import annotations

import os
import shutil

import h5py
import numpy as np
import pytest

from conftest import check_in_groups, rank_failures, shared_tmpdir
from layouts import compare, reference, small_config, token_source
from untrusted import reseal
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
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank

    model = before.get("model", "llama")
    after = dict(after, model=model)
    with rank_failures(world) as fails, shared_tmpdir(world, "mpipar-ckpt-") as root:
        a = build_rank(validate(small_config(**before), 8), world, source=token_source())
        trainer.train_step(a, 0)
        path = writer.save(a.state, trainer.run_position(a, 1), root, Group(world, "world", Ledger()))
        params = trainer.gather_params(a)
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
        b = build_rank(validate(small_config(**after), 8), world, source=token_source())
        if reader.load(b.state, path) != 1:
            fails.append("load did not return step 1")
        r2 = trainer.train_step(b, 1)
        ref = reference(model=model)
        fails += compare(([ref[0][0], r2.loss], [ref[1][0], r2.grad_norm], trainer.gather_params(b)),
                         ref, 1e-10)
        ends = b.comms.groups["pp_ends"]
        if model == "tied" and ends.size > 1:  # the two copies loaded and updated alike
            copies = ends.comm.allgather(b.params["embed_tokens.weight"])
            fails += [] if np.array_equal(*copies) else ["tied copies differ after resume"]


def _damage(ck, how: str) -> None:
    """Damage the copy ``ck`` of an 8-shard checkpoint (rank 0, before the others look)."""
    shard = ck / "shard_00005.h5"
    if how in ("missing", "two"):
        shard.unlink()
    if how in ("truncated", "two"):
        other = ck / "shard_00002.h5"
        other.write_bytes(other.read_bytes()[:-100])
    if how == "flipped":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    if how == "symlink":
        outside = ck.parent / "outside.h5"
        shutil.copy(shard, outside)
        shard.unlink()
        shard.symlink_to(outside)
    if how == "virtual":    # a dataset read from another file, the checkpoint sealed again
        with h5py.File(shard, "r+") as f:
            names: list[str] = []
            f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
            shape = f[names[0]].shape
            del f[names[0]]
            layout = h5py.VirtualLayout(shape=shape, dtype="f8")
            layout[...] = h5py.VirtualSource(str(ck / "shard_00001.h5"), names[0], shape=shape)
            f.create_virtual_dataset(names[0], layout)
        reseal(ck)


DAMAGES = ("sound", "missing", "truncated", "flipped", "symlink", "virtual", "two")
EXPECT = {"sound": ("value", "[]"), "missing": ("value", "missing shard"),
          "truncated": ("value", "truncated"), "flipped": ("value", "(corrupted)"),
          "symlink": ("CheckpointError", "symbolic link"),
          "virtual": ("CheckpointError", "a virtual dataset"),
          "two": ("value", "shard_00005.h5: missing shard"), "resume": ("value", "falling back")}
"""What one rank verifying alone finds in each (the kind of answer, words in it)."""


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("size", (8, 3))
def test_ranks_verify_a_checkpoint_together_as_one_rank_does_alone(world, size, monkeypatch):
    """``verify(path, peers)``: each of the ranks hashes its share of the 8 shard files (every
    shard once in all), and every rank gets the answer one rank gets verifying alone, for a
    sound checkpoint and each kind of damage (problems in the same order, the same error);
    ``resolve_resume`` together falls back past a damaged latest checkpoint as alone does. In
    groups of 8, and of 3, 3 and 2 ranks (shards not dealt evenly)."""
    from mpipar.checkpoint import reader, writer
    from mpipar.config import ConfigError
    from mpipar.runtime.comm import Group, Ledger
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank

    with shared_tmpdir(world, "mpipar-verify-") as root:
        a = build_rank(validate(small_config(dp=8, zero=1), 8), world, source=token_source())
        trainer.train_step(a, 0)
        path = writer.save(a.state, trainer.run_position(a, 1), root / "saved",
                           Group(world, "world", Ledger()))
        trainer.close(a)
        if world.rank == 0:
            for how in DAMAGES:
                shutil.copytree(path, root / how / path.name)
                _damage(root / how / path.name, how)
            # --resume auto: the latest (step 2) damaged, step 1 sound
            shutil.copytree(path, root / "auto" / "step_00000001")
            shutil.copytree(root / "flipped" / path.name, root / "auto" / "step_00000002")
            (root / "auto" / "latest").write_text("step_00000002\n")
        world.Barrier()
        hashed: list[str] = []
        plain = reader.sha256_file
        monkeypatch.setattr(reader, "sha256_file",
                            lambda f: hashed.append(os.path.basename(f)) or plain(f))

        def outcome(fn):
            reader.forget_verified()
            hashed.clear()
            try:
                return ("value", fn()), [n for n in hashed if n.startswith("shard_")]
            except (reader.CheckpointError, ConfigError) as exc:
                return (type(exc).__name__, str(exc)), [n for n in hashed if n.startswith("shard_")]

        def check(comm) -> list[str]:
            peers, fails = reader.Peers.of(comm), []
            for how in (*DAMAGES, "resume"):
                ck = root / how / path.name
                if how == "resume":
                    alone, _ = outcome(lambda: reader.resolve_resume("auto", root / "auto"))
                    together, mine = outcome(lambda: reader.resolve_resume(
                        "auto", root / "auto", peers))
                else:
                    alone, _ = outcome(lambda: reader.verify(ck))
                    together, mine = outcome(lambda: reader.verify(ck, peers))
                kind, words = EXPECT[how]
                if alone[0] != kind or words not in repr(alone[1]) or (
                        how == "two" and len(alone[1]) != 2):
                    fails.append(f"{how}: alone {alone!r:.300}, expected {kind} with {words!r}")
                if together != alone:
                    fails.append(f"{how}: together {together!r:.300}, alone {alone!r:.300}")
                if how == "sound" and together != ("value", []):
                    fails.append(f"the sound checkpoint: {together!r:.300}")
                if how == "sound":
                    everyone = sorted(n for names in comm.allgather(mine) for n in names)
                    want = sorted(f"shard_{i:05d}.h5" for i in range(8))
                    if everyone != want or len(mine) > -(-8 // comm.size):
                        fails.append(f"shards hashed: {mine} here, {everyone} in all")
            return fails

        check_in_groups(world, size, check)
