"""Activation recomputation and offload in one process: every ``--recompute`` mode trains
bit-identically to ``none``, and each keeps exactly the tensors its definition says.

The stage with each mode (also with the zero-bubble input/weight split, whose deferred
``(dy, x)`` references must outlive the recomputed caches) gives the same loss and gradients as
``none``, bit for bit; the bytes each mode keeps per block equal an analytic count; the engine
trains 2 steps identically in every mode (:mod:`recompute_runs`). Layouts under ``mpirun -n 8``:
mpi/test_recompute.py."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from mpi4py import MPI

from mpipar.checkpoint.activations import OffloadStore
from mpipar.config import ModelConfig, TrainConfig
from mpipar.kernels import get_backend
from mpipar.layout import resolve_model
from mpipar.model.attention import LocalAttention
from mpipar.model.llama import BlockSaved, LlamaStage
from mpipar.model.params import init_params
from mpipar.model.recompute import MODES as BY_NAME
from mpipar.model.recompute import RECOMPUTE_MODES, Recompute
from mpipar.parallel.placement import PlacementTable
from mpipar.parallel.tensor.ops import TensorParallel
from recompute_runs import MODES, identical, run_mode

CFG = resolve_model(ModelConfig(vocab_size=11, hidden=16, layers=2, heads=4, kv_heads=2, ffn_hidden=24,
                  init_std=0.3))
TIED = dataclasses.replace(CFG, tie_embeddings=True, attention_bias=True)  # biases recomputed too
QK_NORM = dataclasses.replace(CFG, qk_norm=True, head_dim=6)    # the q/k norms' record too
GEMMA3 = dataclasses.replace(  # the sandwich norms' record, GeGLU, a local RoPE base, q scaled
    QK_NORM, norm_placement="sandwich", norm_unit_offset=True, embed_scale=True,
    ffn_activation="gelu_tanh", query_pre_attn_scalar=4.0, sliding_window=3, window_layers="0",
    rope_local_theta=100.0, tie_embeddings=True)


def _stage(mode: str, store=None, cfg: ModelConfig = CFG, backend: str = "numpy") -> LlamaStage:
    k = get_backend(backend)
    return LlamaStage(cfg=cfg, kernels=k, layers=range(cfg.layers), first=True, last=True,
                      tp=TensorParallel(kernels=k, table=PlacementTable(model=cfg)),
                      attention=LocalAttention(k), recompute=mode, store=store)


def _loss_and_grads(stage: LlamaStage, split: bool):
    rng = np.random.default_rng(4)
    params = {n: rng.normal(0, 0.3, v.shape) if n.endswith(".bias") else v
              for n, v in init_params(stage.cfg, 4, np.float64).items()}
    rng = np.random.default_rng(5)
    tokens, targets = rng.integers(0, 11, (2, 7)), rng.integers(0, 11, (2, 7))
    loss, cache = stage.forward(params, tokens, np.arange(7), targets)
    grads = {n: np.zeros_like(v) for n, v in params.items()}
    deferred: list | None = [] if split else None
    stage.backward(params, grads, np.full(tokens.shape, 1.0 / tokens.size), cache, deferred)
    if split:
        assert len(deferred) == 7 * CFG.layers + 1  # every linear of every block, and the head
        stage.weight_backward(grads, deferred)
    return loss, grads


@pytest.mark.parametrize("cfg", [CFG, TIED, QK_NORM, GEMMA3],
                         ids=["llama", "tied-bias", "qk-norm", "gemma3"])
@pytest.mark.parametrize("split", [False, True], ids=["fused", "zb-split"])
@pytest.mark.parametrize("mode", MODES)
def test_stage_modes_equal_none_bitwise(mode, split, cfg, tmp_path):
    store = OffloadStore(tmp_path / "scratch.h5") if mode == "offload" else None
    loss, grads = _loss_and_grads(_stage(mode, store, cfg), split)
    ref_loss, ref_grads = _loss_and_grads(_stage("none", cfg=cfg), split)
    assert np.array_equal(loss, ref_loss)
    for name, g in ref_grads.items():
        assert np.array_equal(grads[name], g), name
    if store is not None:
        assert store.in_flight == 0  # every block and the head were read back
        store.close()
        assert not store.path.exists()


def _kept_bytes(tree) -> int:
    """Bytes of the distinct array buffers reachable from ``tree`` (views count once)."""
    seen: dict[int, int] = {}

    def walk(node):
        if dataclasses.is_dataclass(node):
            for f in dataclasses.fields(node):
                walk(getattr(node, f.name))
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)
        elif isinstance(node, np.ndarray):
            base = node
            while isinstance(base.base, np.ndarray):
                base = base.base
            seen[id(base)] = base.nbytes
    walk(tree)
    return sum(seen.values())


def test_each_mode_keeps_what_it_says():
    """Per block, in float64 elements: none keeps x, h1, q, k, v, attention out, lse, x2, h2,
    g, u, m, rstd1, rstd2 (o_proj's input is the attention output, reshaped when backward needs
    it); selective keeps x, x2, attention out, lse, g, u; full keeps x."""
    B, S = 2, 7
    H, F, D, hq, hkv = CFG.hidden, CFG.ffn_hidden, CFG.head_dim, CFG.heads, CFG.kv_heads
    tok = B * S
    want = {"none": tok * (H + H + hq * D + 2 * hkv * D + hq * D + hq + H + H + 3 * F + 2),
            "selective": tok * (H + H + hq * D + hq + 2 * F),
            "full": tok * H}
    params = init_params(CFG, 4, np.float64)
    tokens = np.random.default_rng(0).integers(0, 11, (B, S))
    for mode, elements in want.items():
        stage = _stage(mode)
        stage.last = False  # blocks only: the head's context is the same in every mode
        _, cache = stage.forward(params, tokens, np.arange(S))
        per_block = [_kept_bytes(b) for b in cache.blocks]
        assert per_block == [8 * elements] * CFG.layers, (mode, per_block, 8 * elements)


def test_the_qk_norm_record_is_what_the_planner_counts():
    """With qk_norm, none keeps q and k before their norms and the rstds (per token (hq + hkv)
    x (D + 1) values), selective drops them (rebuilt in backward), and the planner's count of
    the field is the record's bytes."""
    from mpipar.config import Config, ParallelConfig
    from mpipar.plan.memory import _block_field_bytes
    from mpipar.rules import validate
    B, S, D, hq, hkv = 2, 7, QK_NORM.head_dim, QK_NORM.heads, QK_NORM.kv_heads
    params = init_params(QK_NORM, 4, np.float64)
    tokens = np.random.default_rng(0).integers(0, 11, (B, S))
    kept = {}
    for mode in ("none", "selective"):
        stage = _stage(mode, cfg=QK_NORM)
        stage.last = False
        kept[mode] = stage.forward(params, tokens, np.arange(S))[1].blocks[0].qk
    assert _kept_bytes(kept["none"]) == 8 * B * S * (hq + hkv) * (D + 1) and kept["selective"] is None
    layout = validate(Config(QK_NORM, ParallelConfig(),
                             TrainConfig(seq_len=S, global_batch_size=B, dtype="float64")), 1)
    assert _block_field_bytes(layout)["qk"] == _kept_bytes(kept["none"])


def test_the_sandwich_norms_record_is_what_the_planner_counts():
    """With sandwich norms every in-memory mode but full keeps the two output norms' inputs and
    rstds (per token 2 x (H + 1) values), and the planner's count of the field is their bytes."""
    from mpipar.config import Config, ParallelConfig
    from mpipar.plan.memory import _block_field_bytes
    from mpipar.rules import validate
    B, S = 2, 7
    params = init_params(GEMMA3, 4, np.float64)
    tokens = np.random.default_rng(0).integers(0, 11, (B, S))
    for mode in ("none", "selective"):
        stage = _stage(mode, cfg=GEMMA3)
        stage.last = False
        kept = stage.forward(params, tokens, np.arange(S))[1].blocks[0].post_norms
        assert _kept_bytes(kept) == 8 * B * S * 2 * (GEMMA3.hidden + 1), mode
    layout = validate(Config(GEMMA3, ParallelConfig(),
                             TrainConfig(seq_len=S, global_batch_size=B, dtype="float64")), 1)
    assert _block_field_bytes(layout)["post_norms"] == _kept_bytes(kept)


def test_offload_keeps_only_handles_in_memory(tmp_path):
    store = OffloadStore(tmp_path / "s.h5")
    stage = _stage("offload", store)
    params = init_params(CFG, 4, np.float64)
    tokens = np.random.default_rng(0).integers(0, 11, (2, 7))
    _, cache = stage.forward(params, tokens, np.arange(7), tokens)
    assert [type(b) for b in cache.blocks] == [int] * CFG.layers
    assert isinstance(cache.head, int) and store.in_flight == CFG.layers + 1
    store.close()


def test_modes_answer_from_the_records_fields():
    """Each mode keeps fields of :class:`BlockSaved` by name (a misspelt name would drop a field
    silently), the configuration resolves every ``--recompute`` name to its mode, and the
    questions the planner asks have each mode's answer."""
    names = {f.name for f in dataclasses.fields(BlockSaved)}
    assert all(m.keeps is None or m.keeps <= names for m in BY_NAME.values())
    assert [TrainConfig(recompute=n).recompute_mode for n in RECOMPUTE_MODES] == \
        list(BY_NAME.values())
    sizes = {name: 1 << i for i, name in enumerate(sorted(names))}
    kept = {n: m.resident_bytes(sizes) for n, m in BY_NAME.items()}
    assert kept == {"none": sum(sizes.values()), "offload": 0, "full": sizes["x"],
                    "selective": sum(sizes[f] for f in ("x", "x2", "attention_out",
                                                        "attention_saved", "g", "u", "moe",
                                                        "shared_gate", "post_norms"))}
    assert {n: m.forward_runs(True) for n, m in BY_NAME.items()} == \
        {"none": 1, "selective": 1, "full": 2, "offload": 1}
    assert all(m.forward_runs(False) == 1 for m in BY_NAME.values())
    assert {n: m.redo_seconds(3.0, 0.5) for n, m in BY_NAME.items()} == \
        {"none": 0.0, "selective": 0.5, "full": 3.0, "offload": 0.0}
    with pytest.raises(ValueError, match="recompute='sometimes': must be one of none, "):
        Recompute.named("sometimes")


def test_bad_modes_are_rejected():
    with pytest.raises(ValueError, match="recompute='sometimes'"):
        _stage("sometimes")
    with pytest.raises(ValueError, match="needs a store"):
        _stage("offload")


@pytest.mark.parametrize("train", [{}, dict(micro_batch_size=2, global_batch_size=8)],
                         ids=["mb1", "mb2"])
def test_engine_modes_equal_none_bitwise(train, tmp_path):
    ref = run_mode({}, "none", MPI.COMM_SELF, str(tmp_path), **train)
    for mode in MODES:
        assert identical(run_mode({}, mode, MPI.COMM_SELF, str(tmp_path), **train), ref) == [], mode
    assert not (tmp_path / "scratch").exists()  # the offload scratch file and folder are gone


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_numba_stage_modes_equal_none_bitwise(mode):
    """With the Numba kernels too: forward fuses the residual add into the post-attention norm,
    selective recomputation renorms the kept sum alone, and both give the same bits."""
    pytest.importorskip("numba")
    loss, grads = _loss_and_grads(_stage(mode, backend="numba"), False)
    ref_loss, ref_grads = _loss_and_grads(_stage("none", backend="numba"), False)
    assert np.array_equal(loss, ref_loss)
    assert [n for n, g in ref_grads.items() if not np.array_equal(grads[n], g)] == []


def test_memory_benchmark_reports_every_mode(tmp_path, capsys):
    """``python -m mpipar.bench memory``: every mode trains the same loss, and the memory a step
    adds falls from none to selective to full (offload keeps no block in memory either)."""
    import json

    from mpipar.bench.__main__ import main
    out = tmp_path / "mem.json"
    assert main(["memory", "--layers", "4", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                 "--ffn", "160", "--seq", "64", "--batch", "2", "--micro-batch", "2",
                 "--json", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["memory"]["rows"]}
    assert list(rows) == list(RECOMPUTE_MODES)
    assert len({r["loss"] for r in rows.values()}) == 1
    added = {m: r["activations"] for m, r in rows.items()}
    assert added["none"] > added["selective"] > added["full"]
    assert added["offload"] < added["selective"]
    assert "selective" in capsys.readouterr().out


def test_the_mtp_record_is_what_the_planner_counts():
    """Two multi-token prediction modules keep, beside the stream the head keeps (module 1's
    input), what the planner counts for them: each its block's record, five streams, three
    rstds, its logits and four values per token."""
    from mpipar.config import Config, ParallelConfig
    from mpipar.plan.memory import _block_activation_bytes, _mtp_activation_bytes
    from mpipar.rules import validate
    cfg, B, S = dataclasses.replace(CFG, mtp_depth=2), 2, 7
    rng = np.random.default_rng(0)
    tokens, targets = rng.integers(0, 11, (B, S)), rng.integers(0, 11, (B, S))
    ahead = np.stack([np.where(np.arange(S) + k < S, np.roll(targets, -k, 1), -1)
                      for k in (1, 2)])
    stage = _stage("none", cfg=cfg)
    _, cache = stage.forward(init_params(cfg, 4, np.float64), tokens, np.arange(S), targets,
                             ahead=ahead)
    kept = _kept_bytes(cache.mtp) - cache.mtp[0].h.nbytes
    layout = validate(Config(cfg, ParallelConfig(),
                             TrainConfig(seq_len=S, global_batch_size=B, dtype="float64")), 1)
    block = _block_activation_bytes(layout, Recompute.named("none"), False)
    assert kept == _mtp_activation_bytes(layout, block) == 2 * (
        block + 8 * B * S * (5 * cfg.hidden + 3 + cfg.vocab_size + 4))
