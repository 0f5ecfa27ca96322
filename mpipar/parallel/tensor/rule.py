"""The tensor axis's rule: what tp must divide."""
from __future__ import annotations

from mpipar.config import require
from mpipar.layout import Layout


def check_config(layout: Layout) -> None:
    """The tensor-parallel split must divide the heads and the FFN; sequence parallelism inside
    tp must divide each microbatch's tokens."""
    m, p, t = layout.model, layout.parallel, layout.train
    require(m.heads % p.tp == 0, f"parallel.tp={p.tp}: must divide model.heads={m.heads}")
    require(m.kv_heads % p.tp == 0,
             f"parallel.tp={p.tp}: must divide model.kv_heads={m.kv_heads}")
    require(m.ffn_hidden % p.tp == 0,
             f"parallel.tp={p.tp}: must divide model.ffn_hidden={m.ffn_hidden}")
    if p.tp_sequence_parallel and p.tp > 1:
        micro = layout.micro_batch_size
        tokens = micro * (t.seq_len // p.sp)
        require(tokens % p.tp == 0,
                 f"parallel.tp_sequence_parallel: the tokens of a microbatch on one rank, "
                 f"micro_batch_size*seq_len/sp = {micro}*{t.seq_len}/{p.sp} = {tokens}, must be "
                 f"divisible by parallel.tp={p.tp}")
