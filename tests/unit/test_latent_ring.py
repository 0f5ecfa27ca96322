"""What the sequence-parallel ring passes under latent attention, at DeepSeek-V3's shape
(128 heads of 192 = 128 nope + 64 rope, values of 128, kv latent 512): each position's latent
and RoPE key, 576 values, against the expanded K and V a rank holds (values zero-padded to the
key width), as the planner books them. The engine's ring equals one process and its ledger the
planner's: mpi/test_layouts.py, mpi/test_planner.py, mpi/test_moe.py."""
from __future__ import annotations

from mpipar.config import Config, ModelConfig, ParallelConfig, TrainConfig
from mpipar.layout import resolve
from mpipar.parallel.sequence.mode import SequenceTraffic
from mpipar.runtime.topology import Coord, GridShape

DEEPSEEK_V3 = dict(vocab_size=64, hidden=7168, layers=2, heads=128, kv_heads=128, head_dim=192,
                   latent_kv_rank=512, latent_q_rank=1536, rope_head_dim=64, v_head_dim=128,
                   ffn_hidden=64)


def _traffic(tp: int, **model) -> SequenceTraffic:
    cfg = Config(ModelConfig(**{**DEEPSEEK_V3, **model}), ParallelConfig(sp=2, tp=tp),
                 TrainConfig(seq_len=64, global_batch_size=1, micro_batch_size=1,
                             dtype="bfloat16"))
    layout = resolve(cfg, 2 * tp)
    return SequenceTraffic(layout, Coord(0, 0, 0, 0), GridShape(1, tp, 1, 2), (0, 1), 1, 1)


def test_the_ring_books_the_latent_at_deepseek_v3_shape():
    """A position's block message in bf16: 576 x 2 bytes of latent, 85.3x fewer than the
    expanded K and V (2 x 128 x 192 x 2) on one tp rank, 10.7x at tp 8; its gradient in the
    float32 accumulator. A latent wider than the expanded K and V (one head of 4 a rank, at tp
    128) travels expanded."""
    one, eight = _traffic(1), _traffic(8)
    assert (one.ring_row, one.ring_grad_row) == (576 * 2, 576 * 4)
    assert eight.ring_row == 576 * 2
    assert (2 * one.row / one.ring_row, 2 * eight.row / eight.ring_row) == (49152 / 576,
                                                                            6144 / 576)
    print(f"\nring bytes a position, latent vs expanded: {2 * one.row / one.ring_row:.1f}x "
          f"(tp 1), {2 * eight.row / eight.ring_row:.1f}x (tp 8)")
    narrow = _traffic(128, head_dim=68, latent_kv_rank=256, rope_head_dim=4, v_head_dim=64)
    assert narrow.ring_row == 2 * narrow.row == 2 * 68 * 2
