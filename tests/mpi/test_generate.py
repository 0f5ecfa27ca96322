"""Generation on 8 ranks: greedy and seeded sampled tokens from one checkpoint are the same on
every tp x pp layout as on one rank, logits to 1e-10; latent attention's cache of compressed
latents gives the expanded cache's tokens on tp x pp."""
from __future__ import annotations

import tempfile

import numpy as np
import pytest

from conftest import assert_all_ranks
from generation import build_generator
from layouts import small_config, token_source
from mpipar.inference.sampling import Sampling
from mpipar.rules import validate
from mpipar.runtime.comm import Group, Ledger


# --------------------------------------------------------------- every layout (8 ranks)
GEN_LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (2, 4)]   # (tp, pp)
SAMPLED = Sampling(0.9, top_k=8, top_p=0.95)


@pytest.mark.mpi(min_size=8)
def test_generation_is_the_same_on_every_layout(world):
    """A checkpoint saved under dp=2 x tp=2 x pp=2 after one step, read directly by each tp x pp
    layout: greedy and seeded sampled tokens equal one rank's, logits to 1e-10."""
    from mpipar.checkpoint import reader, writer
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    fails: list[str] = []
    root = world.bcast(tempfile.mkdtemp(prefix="mpipar-test-gen-") if world.rank == 0 else None)
    cfg = validate(small_config(dp=2, tp=2, pp=2), 8)
    rank = build_rank(cfg, world, source=token_source())
    trainer.train_step(rank, 0)
    path = writer.save(rank.state, trainer.run_position(rank, 1), root,
                           Group(world, "world", Ledger()))
    runs = {}
    for tp, pp in GEN_LAYOUTS:
        comm = world.Split(world.rank // (tp * pp), world.rank)
        try:
            generator = build_generator(cfg.model, comm, tp, pp)
            with reader.open_reader(path) as read:
                generator.load_checkpoint(read)
            runs[(tp, pp)] = [generator.generate([1, 5, 7], 8, s, seed=4, keep_logits=True)
                              for s in (Sampling(0.0), SAMPLED)]
            generator.close()
        except Exception as exc:  # a rank's error must reach every rank, never hang them
            fails.append(f"tp={tp} pp={pp}: {type(exc).__name__}: {exc}")
        comm.Free()
    one = runs.get((1, 1))
    worst = 0.0
    for layout, (greedy, sampled) in runs.items():
        for what, got, want in (("greedy", greedy, one and one[0]),
                                ("sampled", sampled, one and one[1])):
            if want is None or got.ids != want.ids:
                fails.append(f"{layout} {what}: {got.ids} vs one rank {want and want.ids}")
                continue
            err = max(float(np.abs(a - b).max() / np.abs(b).max())
                      for a, b in zip(got.logits, want.logits))
            worst = max(worst, err)
            if not err <= 1e-10:
                fails.append(f"{layout} {what}: logits rel diff {err:.2e}")
    if world.rank == 0:
        print(f"\ngeneration on {sorted(runs)} (tp, pp): ids equal one rank's, logits max rel "
              f"diff {worst:.2e}")
    if one is not None and one[0].ids == one[1].ids:
        fails.append("the sampled tokens equal the greedy ones: sampling was not exercised")
    assert_all_ranks(world, fails)


LATENT_LAYOUTS = [(1, 1, False), (1, 1, True), (2, 2, True), (4, 2, True)]   # tp, pp, latent


@pytest.mark.mpi(min_size=8)
def test_latent_cache_generation_is_the_same_on_tp_and_pp(world):
    """Latent attention (random weights) decoding from the cache of compressed latents and RoPE
    keys, whole on every tp rank: on each tp x pp layout the greedy tokens equal one rank's with
    the expanded cache, logits to 1e-10, and each rank's cache holds its blocks' analytic bytes
    a position (:func:`kv_cache_width`)."""
    from mpipar.layout import resolve_model
    from mpipar.model.params import init_params
    from mpipar.plan.memory import kv_cache_width
    model = resolve_model(small_config(model="latent").model)
    params = init_params(model, 3, np.float64)
    prompt, new = [1, 5, 7, 2], 6
    fails: list[str] = []
    runs = {}
    for tp, pp, latent in LATENT_LAYOUTS:
        comm = world.Split(world.rank // (tp * pp), world.rank)
        try:
            generator = build_generator(model, comm, tp, pp)
            generator.load_params(params)
            cache = generator.new_cache(len(prompt) + new, latent)
            runs[(tp, pp, latent)] = generator.generate(prompt, new, Sampling(0.0), cache=cache,
                                                        keep_logits=True)
            width = (kv_cache_width(model, tp) if latent
                     else 2 * model.kv_heads // tp * model.head_dim)
            want = len(generator.stage.layers) * (len(prompt) + new) * 8 * width
            generator.close()
            if cache.nbytes != want:
                fails.append(f"tp={tp} pp={pp}: cache of {cache.nbytes} B, predicted {want}")
        except Exception as exc:  # a rank's error must reach every rank, never hang them
            fails.append(f"tp={tp} pp={pp}: {type(exc).__name__}: {exc}")
        comm.Free()
    one = runs.get((1, 1, False))
    for key, got in runs.items():
        if one is None or got.ids != one.ids:
            fails.append(f"{key}: {got.ids} vs one rank's expanded {one and one.ids}")
            continue
        err = max(float(np.abs(a - b).max() / np.abs(b).max())
                  for a, b in zip(got.logits, one.logits))
        if not err <= 1e-10:
            fails.append(f"{key}: logits rel diff {err:.2e}")
    assert_all_ranks(world, fails)
