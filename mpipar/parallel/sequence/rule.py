"""The rule of sequence parallelism: the split's, then the mode's own."""
from __future__ import annotations

from mpipar.config import require
from mpipar.layout import Layout
from mpipar.parallel.sequence.registry import SP_MODES, sequence_mode
from mpipar.parallel.sequence.split import split_of


def check_config(layout: Layout) -> None:
    """The sequence must cut into the split's equal parts; the balanced split deals documents
    over a mode that may deal them; then the mode's rule (Ulysses: each rank's heads divide
    into sp groups; hybrid: a Ulysses group size that divides sp and the heads)."""
    p, t = layout.parallel, layout.train
    mode = sequence_mode(p)
    split = split_of(p)
    require(t.seq_len % split.parts(p.sp) == 0,
            f"train.seq_len={t.seq_len}: must be divisible by {split.parts_named(p.sp)}")
    dealers = " or ".join(f"--sp-mode {m.name}" for m in SP_MODES.values() if m.balanced_split)
    require(not split.deals_documents or (t.document_masking and mode.balanced_split),
            f"parallel.sp_split='balanced': deals each microbatch's documents over ring "
            f"attention; needs --document-masking and {dealers} (got "
            f"document_masking={t.document_masking}, sp_mode={mode.name!r})")
    require(p.sp_min_chunk >= 1, f"parallel.sp_min_chunk={p.sp_min_chunk}: must be >= 1 "
                                 f"(tokens in a chunk of --sp-split balanced)")
    require(p.ulysses_size >= 0, f"parallel.ulysses_size={p.ulysses_size}: must be >= 0")
    mode.check(layout)
