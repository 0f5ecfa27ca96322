"""Layout invariance, the heart of mpipar: every layout equals the single-process run.

Under ``mpirun -n 8``: for the small model of ``layouts.py`` (vocabulary 13, kv heads < heads),
every (dp, tp, pp, sp) with dp*tp*pp*sp in {2, 4, 8} that the model admits, and each pipeline
schedule, SP split and mode and ZeRO stage on a covering set of those layouts (each axis split
and unsplit, and each world size, at least once: ``conftest.covering``) gives, after 2
optimizer steps, the same losses, gradient norms and (gathered) parameters as one process:
<= 1e-10 relative in float64, <= 1e-5 in float32. A layout of 2 or 4 ranks runs on one 2- or
4-rank slice of the world, chosen by the test's name. A covering set of the layouts with tp > 1
runs again with ``--tp-sequence-parallel``. A covering set of the layouts of 4 and 8 ranks whose
nodes of 2 or 4 ranks hold more than one rank of a dp x sp group, and more than one node, runs
with hierarchical reduction (each node size, with and without ZeRO-1, several buckets), and a
covering set of the layouts with sp of 4 or 8 runs hybrid attention (Ulysses over 2 ranks, ring
across; each split, with and without overlap, on nodes of 2 and 4 ranks). ZeRO-2 and ZeRO-3 (sharded gradients, and parameters gathered per layer) run on a
covering set of the base layouts with dp x sp > 1, then with every schedule, SP mode and split,
tp sequence parallelism, prefetch depths 0, 1 and 2, and the tied, scaled and windowed models
(their recompute modes are in ``test_recompute.py``); ZeRO-3 with the parameters in node shared
memory on layouts of its own. A model with tied embeddings, q/k/v biases and llama3 RoPE, and
one with biases and dynamic RoPE, run on layouts chosen for them.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import check_in_groups, covering, factorisations
from layouts import (REFERENCE_RESULTS, compare, layout_name, layout_size, reference, run,
                     small_config)
from mpipar.parallel.placement import TENSOR_PARALLEL_PLAN
from mpipar.runtime.topology import GridShape, NodeMap
from mpipar.training import step as trainer


def _admitted(dp, tp, pp, sp) -> bool:
    return tp <= 2 and pp <= 4  # kv_heads = 2, layers = 4


BASE = [f for w in (2, 4, 8) for f in factorisations(w) if _admitted(*f)]


OPTIONS = [dict(schedule="gpipe"), dict(schedule="zb-h1"),
           dict(schedule="interleaved", virtual_stages=2), dict(sp_split="zigzag"),
           dict(sp_overlap=True), dict(sp_mode="ulysses"),
           dict(sp_mode="ulysses", sp_split="zigzag"), dict(zero=1, bucket_mb=0.002)]
"""What runs on the base layouts beside the defaults: each schedule, SP split and mode, ZeRO-1."""


def _fits(option: dict, dp: int, tp: int, pp: int, sp: int) -> bool:
    if "schedule" in option:
        return pp > 1 and (option["schedule"] != "interleaved" or pp == 2)
    if option.get("sp_mode") == "ulysses":
        return sp > 1 and (2 // tp) % sp == 0
    if "sp_split" in option or "sp_overlap" in option:
        return sp > 1
    return dp * sp > 1      # ZeRO-1


def _variants(keep=lambda dp, tp, pp, sp: True, every_base: bool = True):
    """The base layouts (every one, or a covering set), then each option on a covering set of
    the bases that admit it (:func:`conftest.covering`: each axis split and unsplit, each world
    size)."""
    bases = [dict(dp=dp, tp=tp, pp=pp, sp=sp) for dp, tp, pp, sp in BASE if keep(dp, tp, pp, sp)]
    out = list(bases) if every_base else covering(bases)
    for option in OPTIONS:
        out += covering([dict(b, **option) for b in bases if _fits(option, **b)])
    return out


def _nodes_split(dp, tp, pp, sp, k) -> bool:
    """Nodes of ``k`` ranks hold several ranks of a dp x sp group, and there are several."""
    shape = GridShape(dp, tp, pp, sp)
    per_node = len(shape.node_split(0, NodeMap.blocks(shape.world, k))[0])
    return 1 < per_node < dp * sp


HIERARCHICAL = covering([dict(dp=dp, tp=tp, pp=pp, sp=sp, ranks_per_node=k, dp_reduce="hierarchical",
                     bucket_mb=0.002, **zero)
                for dp, tp, pp, sp in BASE for k in (2, 4)
                for zero in ({}, {"zero": 1})[:1 + ((k == 2) == (dp * tp * pp * sp == 4))]
                if k < dp * tp * pp * sp and _nodes_split(dp, tp, pp, sp, k)],
                        options=("ranks_per_node", "zero"))
HYBRID = covering([dict(dp=dp, tp=tp, pp=pp, sp=sp, sp_mode="hybrid", ulysses_size=2, **extra)
          for dp, tp, pp, sp in BASE if sp >= 4 and tp == 1
          for extra in ({}, {"sp_split": "zigzag"},
                        {"sp_split": "zigzag", "sp_overlap": True, "ranks_per_node": 2},
                        {"ranks_per_node": 4})[:3 + (dp * pp * sp == 8)]],
                  options=("sp_split", "sp_overlap", "ranks_per_node"))
VARIANTS = _variants() + HIERARCHICAL + HYBRID
TP_SEQUENCE_PARALLEL = [dict(v, tp_sequence_parallel=True) for v in covering(
    _variants(lambda dp, tp, pp, sp: tp > 1, every_base=False),
    options=("schedule", "sp_split", "sp_mode", "sp_overlap", "zero"))]
# ZeRO-2 and ZeRO-3 on a covering set of the base layouts with dp x sp > 1, then with each schedule, SP mode and
# split, tp sequence parallelism, prefetch depths and the tied and scaled models.
ZERO_BASE = [case for zero in (2, 3) for case in covering(
    [dict(dp=dp, tp=tp, pp=pp, sp=sp, zero=zero) for dp, tp, pp, sp in BASE if dp * sp > 1])]
ZERO = ZERO_BASE + [
        dict(dp=2, zero=3, zero_prefetch=0),
        dict(dp=2, pp=2, zero=3), dict(dp=2, pp=2, zero=2, schedule="gpipe"),
        dict(dp=2, pp=2, zero=3, schedule="zb-h1"),
        dict(dp=2, pp=2, zero=3, schedule="interleaved", virtual_stages=2),
        dict(dp=2, tp=2, zero=3, tp_sequence_parallel=True),
        dict(sp=2, tp=2, zero=3, sp_split="zigzag", sp_overlap=True),
        dict(dp=2, sp=2, zero=2, sp_mode="ulysses"),
        dict(dp=8, zero=3, zero_prefetch=2),
        dict(dp=2, tp=2, pp=2, zero=3, schedule="zb-h1"),
        dict(dp=2, sp=2, pp=2, zero=3, schedule="interleaved", virtual_stages=2),
        dict(dp=2, sp=2, tp=2, zero=3, tp_sequence_parallel=True, sp_split="zigzag"),
        dict(model="tied", pp=2, dp=2, zero=3), dict(model="tied", pp=2, dp=2, zero=2,
                                                      schedule="zb-h1"),
        dict(model="tied", dp=2, tp=2, schedule="interleaved", virtual_stages=2, zero=3),
        dict(model="dynamic", sp=2, dp=2, zero=3, sp_split="zigzag"),
        dict(dp=2, sp=4, zero=3, sp_mode="hybrid", ulysses_size=2, sp_split="zigzag"),
        dict(model="window", sp=4, dp=2, zero=3, sp_mode="halo"),
        dict(model="gemma", sp=2, dp=2, pp=2, zero=2, sp_split="zigzag")]
# ZeRO-3 with the parameters in node shared memory: alone, at 8 ranks, with each schedule,
# TP and SP modes and the tied model (one node: no all-gathers); on declared nodes of 2 and 4
# (a copy on each node, the updated slices all-gathered across nodes once a step); and where a
# node holds one rank of a group (the units gathered).
ZERO_SHARED = [(dict(v, zero=3, zero_shared="node"), held) for v, held in (
    (dict(dp=2), "one node"), (dict(dp=8), "one node"),
    (dict(dp=2, pp=2, schedule="zb-h1"), "one node"),
    (dict(dp=2, tp=2, pp=2, schedule="interleaved", virtual_stages=2), "one node"),
    (dict(dp=2, sp=2, tp=2, tp_sequence_parallel=True, sp_split="zigzag"), "one node"),
    (dict(dp=4, sp=2, sp_mode="ulysses"), "one node"),
    (dict(model="tied", pp=2, dp=2), "one node"),
    (dict(dp=4, pp=2, ranks_per_node=2), "node copies"),
    (dict(dp=8, ranks_per_node=4), "node copies"),
    (dict(dp=2, sp=2, tp=2, ranks_per_node=4, sp_split="zigzag"), "node copies"),
    (dict(model="tied", dp=4, pp=2, ranks_per_node=2, schedule="interleaved",
          virtual_stages=2), "node copies"),
    (dict(dp=4, tp=2, ranks_per_node=2), "gathered"))]
FLOAT32 = [dict(dp=2, tp=2, pp=2), dict(sp=4, tp=2, sp_split="zigzag"),
           dict(pp=4, dp=2, schedule="zb-h1"), dict(dp=4, sp=2, zero=1)]

# Tied embeddings with q/k/v biases and llama3 RoPE: the tie across pipeline ranks (pp > 1:
# every schedule, with ZeRO-1 and small buckets), inside one rank's two chunks (pp = 1,
# interleaved), under TP (vocabulary-parallel on both ends, biases split with their heads, with
# and without tp sequence parallelism) and SP.
TIED = [dict(model="tied", **v) for v in (
    dict(pp=2, tp=2, dp=2), dict(pp=4, dp=2, schedule="zb-h1"),
    dict(pp=2, sp=2, dp=2, schedule="interleaved", virtual_stages=2, zero=1, bucket_mb=0.002),
    dict(pp=1, dp=2, tp=2, schedule="interleaved", virtual_stages=2),
    dict(pp=2, tp=2, sp=2, tp_sequence_parallel=True, schedule="gpipe"),
    dict(pp=2, dp=4, zero=1), dict(tp=2, sp=2, dp=2, zero=1, sp_split="zigzag"))]
# Biases with dynamic NTK RoPE, which depends on the whole sequence's length, under SP splits.
DYNAMIC = [dict(model="dynamic", **v) for v in (
    dict(sp=2, tp=2, dp=2), dict(sp=4, pp=2, sp_split="zigzag"),
    dict(sp=2, dp=2, pp=2, sp_mode="ulysses", zero=1))]

# Sliding-window attention on every SP mode and split, with TP, PP and DP, at 2, 4 and 8 ranks.
WINDOW = [dict(model="window", **v) for v in (
    dict(sp=2), dict(sp=2, dp=2, sp_mode="halo", sp_split="zigzag"),
    dict(sp=2, dp=2, sp_mode="ulysses"), dict(sp=4, tp=2, sp_split="zigzag"),
    dict(sp=4, pp=2, sp_mode="halo"), dict(sp=2, pp=2, dp=2, sp_mode="ulysses", sp_split="zigzag"),
    dict(sp=8, sp_mode="halo", sp_split="zigzag"), dict(sp=8, sp_overlap=True),
    dict(sp=2, tp=2, pp=2, sp_mode="halo", tp_sequence_parallel=True, schedule="zb-h1"),
    dict(pp=2, tp=2, dp=2), dict(sp=4, dp=2, sp_mode="hybrid", ulysses_size=2, sp_split="zigzag"))
] + [dict(model="gemma", **v) for v in (
    dict(sp=4, dp=2, sp_overlap=True, sp_split="zigzag", zero=1, bucket_mb=0.002),
    dict(sp=4, tp=2, sp_mode="halo"), dict(sp=2, pp=2, dp=2, schedule="interleaved",
                                           virtual_stages=2))]


# Qwen3's q/k norms (replicated over tp, applied to each rank's heads: gradients summed over
# tp) and its own head dim, on TP with PP, each SP mode with tp sequence parallelism, zb-h1,
# interleaving and ZeRO-3.
QWEN3 = [dict(model="qwen3", **v) for v in (
    dict(tp=2, pp=2, dp=2), dict(tp=2, sp=2, dp=2, sp_split="zigzag", tp_sequence_parallel=True),
    dict(sp=2, dp=2, pp=2, sp_mode="ulysses", schedule="zb-h1"),
    dict(tp=2, dp=2, zero=3, schedule="interleaved", virtual_stages=2),
    dict(sp=4, tp=2, sp_overlap=True))]

# DeepSeek-V3's latent attention with tp sequence parallelism: the latents' down-projections
# read the all-gathered tokens, their input gradient is reduce-scattered (MoE layouts:
# mpi/test_moe.py).
LATENT = [dict(model="latent", tp=2, sp=2, dp=2, sp_mode="ulysses", tp_sequence_parallel=True)]

# Latent attention on the ring, overlapped, both relays of zigzag: each block travels as its
# latent and RoPE key, expanded by the rank that attends it, its gradient latent-sized (the
# plain ring, contiguous and zigzag: mpi/test_moe.py's DeepSeek-V3 layouts).
LATENT_RING = [dict(model="latent", sp=4, tp=2, sp_split="zigzag", sp_overlap=True)]

# Multi-token prediction: its modules on the last pipeline stage with a copy of the embedding
# (tp sequence parallelism: the projection's gradient partial over tp), after zigzag SP chunks
# whose tokens ahead cross their ends, under zb-h1's deferred weight gradients; DeepSeek-V3's
# (latent attention, its module's block sparse) with its experts over ep and ZeRO-3 (the
# modules' units and the embedding gathered with the head).
MTP = [dict(model="mtp", tp=2, pp=2, dp=2, tp_sequence_parallel=True),
       dict(model="mtp", sp=2, dp=2, pp=2, sp_split="zigzag", schedule="zb-h1"),
       dict(model="deepseek_mtp", dp=4, pp=2, ep=2, zero=3)]

# Gemma 3 (its sandwich norms' gradients partial over tp under tp sequence parallelism; its
# local and global layers on the halo exchange and the ring; ZeRO-3 over dp x sp).
GEMMA3 = [dict(model="gemma3", **v) for v in (
    dict(tp=2, pp=2, dp=2, tp_sequence_parallel=True),
    dict(sp=4, tp=2, sp_mode="halo", sp_split="zigzag"),
    dict(sp=2, dp=4, zero=3))]


def _tied_copies_differ(rank) -> list[str]:
    """The two pipeline ranks' copies of a tied embedding must be bit-identical."""
    group = rank.comms.groups["pp_ends"]
    if group.size == 1 or not rank.model.table["embed_tokens.weight"].tied_across_pipeline:
        return []
    copies = group.comm.allgather(rank.params["embed_tokens.weight"])
    if np.array_equal(copies[0], copies[1]):
        return []
    return [f"tied embedding copies differ by {np.abs(copies[0] - copies[1]).max():.3g}"]


def _check(world, layout: dict, dtype: str, tol: float, extra=lambda rank: []) -> None:
    size = layout_size(layout)
    layout = dict(layout)
    model = layout.pop("model", "llama")

    def check(comm) -> list[str]:
        got = run(small_config(dtype, model, **layout), comm)
        try:
            return compare(got[:3], reference(dtype, model=model), tol) + extra(got[3])
        finally:
            trainer.close(got[3])      # its communicators: the suite builds hundreds of ranks

    check_in_groups(world, size, check)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", VARIANTS, ids=[layout_name(v) for v in VARIANTS])
def test_layout_equals_single_process_float64(world, layout):
    _check(world, layout, "float64", 1e-10)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", TP_SEQUENCE_PARALLEL,
                         ids=[layout_name(v) for v in TP_SEQUENCE_PARALLEL])
def test_tp_sequence_parallel_equals_single_process_float64(world, layout):
    """Megatron sequence parallelism inside TP, on every layout of the suite with tp > 1."""
    _check(world, layout, "float64", 1e-10)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", ZERO, ids=[layout_name(v) for v in ZERO])
def test_zero_equals_single_process_float64(world, layout):
    """ZeRO-2/3: gradients (and parameters) sharded over dp x sp change no number."""
    _check(world, layout, "float64", 1e-10)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout,want", ZERO_SHARED,
                         ids=[layout_name(v) for v, _ in ZERO_SHARED])
def test_zero3_node_shared_equals_single_process_float64(world, layout, want):
    """ZeRO-3 reading the parameters in place from node shared memory changes no number, on
    one node and with a copy on each node; it is used where it applies, and no unit is gathered
    per layer then."""
    def how_held(rank) -> list[str]:
        s = rank.weights.sharded
        held = ("gathered" if s.gather else "resident" if not s.shared
                else "node copies" if s.node.inter is not None else "one node")
        fails = [] if held == want else [f"parameters {held}, expected {want}"]
        gathers = rank.ledger.entries.get(("dp_sp", "iallgather"))
        if s.shared and gathers is not None:
            fails.append(f"{gathers.messages} all-gathers with node shared parameters")
        units = sum(u.size for u in s.units.values()) * np.dtype("float64").itemsize
        if s.shared and s.shared_bytes * s.node.intra.size != units:
            fails.append(f"{s.shared_bytes} B of shared memory, not 1/{s.node.intra.size} of the "
                         f"units")
        return fails
    _check(world, layout, "float64", 1e-10, how_held)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", FLOAT32, ids=[layout_name(v) for v in FLOAT32])
def test_layout_equals_single_process_float32(world, layout):
    _check(world, layout, "float32", 1e-5)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", TIED + DYNAMIC, ids=[layout_name(v) for v in TIED + DYNAMIC])
def test_tied_biased_scaled_model_equals_single_process_float64(world, layout):
    """Tied embeddings, attention biases and RoPE scaling keep every layout equal to one process,
    and the tied embedding's copies on the first and the last pipeline stage bit-identical."""
    _check(world, layout, "float64", 1e-10, _tied_copies_differ)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", WINDOW, ids=[layout_name(v) for v in WINDOW])
def test_sliding_window_model_equals_single_process_float64(world, layout):
    """Sliding-window attention (every layer, or Gemma 2's alternation) on ring, halo and
    Ulysses SP, both splits, with TP, PP and DP: equal to one process."""
    _check(world, layout, "float64", 1e-10)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", GEMMA3, ids=[layout_name(v) for v in GEMMA3])
def test_gemma3_model_equals_single_process_float64(world, layout):
    """Gemma 3's blocks (sandwich and (1 + w) norms, scaled embedding, GeGLU, attention scale,
    a RoPE base per layer kind) keep every layout equal to one process."""
    _check(world, layout, "float64", 1e-10)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", QWEN3, ids=[layout_name(v) for v in QWEN3])
def test_qk_norm_model_equals_single_process_float64(world, layout):
    """Qwen3's per-head q/k norms and decoupled head dim keep every layout equal to one
    process."""
    _check(world, layout, "float64", 1e-10)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", MTP, ids=[layout_name(v) for v in MTP])
def test_multi_token_prediction_equals_single_process_float64(world, layout):
    """The MTP modules keep every layout equal to one process (their loss too), and the
    embedding's copies on the first and last stage bit-identical (where they are held whole:
    ZeRO-3 holds slices)."""
    layout, size = dict(layout), layout_size(layout)
    model = layout.pop("model")

    def check(comm) -> list[str]:
        results: list = []
        got = run(small_config("float64", model, **layout), comm, results=results)
        try:
            fails = compare(got[:3], reference("float64", model=model), 1e-10)
            want = [r.mtp_loss for r in REFERENCE_RESULTS["float64", 2, model]]
            fails += [f"mtp_loss {a!r} vs {b!r}" for a, b in
                      zip([r.mtp_loss for r in results], want) if not abs(a - b) <= 1e-10 * b]
            return fails + (_tied_copies_differ(got[3]) if layout.get("zero", 0) < 3 else [])
        finally:
            trainer.close(got[3])

    check_in_groups(world, size, check)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", LATENT, ids=[layout_name(v) for v in LATENT])
def test_latent_attention_model_equals_single_process_float64(world, layout):
    _check(world, layout, "float64", 1e-10)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", LATENT_RING, ids=[layout_name(v) for v in LATENT_RING])
def test_latent_ring_equals_single_process_float64(world, layout):
    _check(world, layout, "float64", 1e-10)


# The MLP's linears replicated over tp in the placement table, instead of column- and
# row-parallel: on tp alone (its all-reduces counted against the usual table's) and with tp
# sequence parallelism and the pipeline.
MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
TABLE_CHANGED = [dict(tp=2), dict(tp=2, pp=2, tp_sequence_parallel=True)]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", TABLE_CHANGED, ids=[layout_name(v) for v in TABLE_CHANGED])
def test_the_placement_table_drives_the_weight_split_and_the_traffic(world, layout, monkeypatch):
    """Each linear's tensor-parallel role is declared once, in the placement table: with the
    MLP's linears replicated there, every tp rank holds them whole, their activations cross no
    tp collective (without tp sequence parallelism: per block and microbatch one all-reduce
    fewer in forward, the down projection's, and one in backward, the gate/up input's), and the
    run still equals one process."""
    want = reference("float64")

    def all_reduces(rank) -> int:
        return rank.ledger.entries[("tp", "allreduce")].messages

    def check(comm) -> list[str]:
        usual = None
        if not layout.get("tp_sequence_parallel"):
            got = run(small_config("float64", **layout), comm)
            usual = all_reduces(got[3])
            trainer.close(got[3])
        for name in MLP:
            monkeypatch.setitem(TENSOR_PARALLEL_PLAN, name, "replicated")
        got = run(small_config("float64", **layout), comm)
        rank = got[3]
        try:
            fails = compare(got[:3], want, 1e-10)
            blocks = [i for chunk in rank.model.chunks for i in chunk.layers]
            held = rank.params[f"layers.{blocks[0]}.mlp.down_proj.weight"].shape
            if held != (32, 48):
                fails.append(f"down_proj held as {held}, not whole")
            if usual is not None and usual - all_reduces(rank) != \
                    2 * len(blocks) * rank.data.microbatches * 2:
                fails.append(f"tp all-reduces {all_reduces(rank)} against {usual} with the "
                             f"usual table")
            return fails
        finally:
            trainer.close(rank)

    check_in_groups(world, layout_size(layout), check)
