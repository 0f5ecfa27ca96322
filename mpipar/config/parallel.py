"""The parallel layout's fields (``[parallel]``): how the world is cut."""
from __future__ import annotations

from dataclasses import dataclass

from mpipar.config.schema import described as _f
from mpipar.parallel.sequence.names import SP_MODE_HELP, sp_mode_help
from mpipar.runtime.allreduce_modes import ALGORITHMS


@dataclass
class ParallelConfig:
    """How the world is cut: world = dp * tp * pp * sp (TP fastest-varying, PP slowest)."""

    dp: int = _f(0, "data-parallel size; 0 fills the world (world // (tp*pp*sp))")
    tp: int = _f(1, "tensor-parallel size (Megatron column/row split of heads, FFN and vocabulary)")
    pp: int = _f(1, "pipeline-parallel size (layers split into stages)")
    sp: int = _f(1, "sequence/context-parallel size (ring attention over the sequence)")
    schedule: str = _f("1f1b", "pipeline schedule", choices=("gpipe", "1f1b", "interleaved", "zb-h1"))
    virtual_stages: int = _f(1, "model chunks per pipeline rank (> 1 needs --schedule interleaved)")
    sp_split: str = _f("contiguous", "how a sequence is cut over SP (zigzag: rank i holds chunks i "
                                     "and 2*sp-1-i, balancing causal work; balanced: with "
                                     "--document-masking and ring attention, chunks dealt per "
                                     "microbatch so every rank's intra-document attention "
                                     "work is equal)",
                       choices=("contiguous", "zigzag", "balanced"))
    sp_min_chunk: int = _f(64, "--sp-split balanced: the fewest tokens in a dealt chunk (a kernel "
                               "tile; the ring makes a kernel call per pair of a rank's runs, "
                               "so smaller chunks balance short documents finer at more calls)")
    sp_mode: str = _f("ring", sp_mode_help(), choices=tuple(SP_MODE_HELP))
    ulysses_size: int = _f(0, "--sp-mode hybrid: sp ranks per Ulysses group (consecutive, so "
                              "on one node when tp x ulysses_size ranks fit in one); the ring "
                              "runs over sp / ulysses_size of them")
    sp_overlap: bool = _f(False, "ring attention: post the next K/V transfer before computing the "
                                 "current block (Isend/Irecv)")
    zero: int = _f(0, "ZeRO stage over dp x sp: 0 (replicated), 1 (optimizer state sharded), "
                      "2 (gradients too), 3 (parameters too: all-gathered per layer before its "
                      "forward and backward, freed after)", choices=(0, 1, 2, 3))
    zero_prefetch: int = _f(1, "ZeRO-3: all-gathers of the next layers posted while one computes")
    zero_shared: str = _f("off", "ZeRO-3 on the CPU: node keeps the parameters in node shared "
                                 "memory, one copy per node (each of the node's ranks of the "
                                 "dp x sp group allocates a part, every one reads all in "
                                 "place: no all-gather per layer; across nodes the updated "
                                 "slices are all-gathered into every copy once a step); off "
                                 "gathers them per layer",
                          choices=("off", "node"))
    bucket_mb: float = _f(25.0, "gradient all-reduce bucket size in MiB (reduction overlaps backward)")
    ranks_per_node: int = _f(0, "ranks per node: 0 asks MPI (ranks that share memory); K treats "
                                "each K consecutive ranks as one node (one machine standing in "
                                "for a cluster)")
    dp_reduce: str = _f("flat", "gradient reduction over dp x sp: flat (one group) or "
                                "hierarchical (reduce-scatter inside the node, all-reduce of the "
                                "shard across nodes, all-gather inside the node)",
                        choices=("flat", "hierarchical"))
    allreduce_algorithm: str = _f("auto", "the MPI library's all-reduce algorithm, set through its "
                                          "own controls before MPI_Init (MPICH's MPIR_CVAR_"
                                          "[I]ALLREDUCE_INTRA_ALGORITHM, Open MPI's coll_tuned / "
                                          "libnbc parameters): auto (the library's choice, or the "
                                          "fastest per size of --allreduce-hardware), ring, tree, "
                                          "rabenseifner (reduce-scatter + all-gather), "
                                          "hierarchical (mpipar's --dp-reduce hierarchical)",
                                  choices=ALGORITHMS)
    allreduce_hardware: str = _f("", "--allreduce-algorithm auto: a hardware file from python -m "
                                     "mpipar.bench comm --algorithms; each all-reduce then runs "
                                     "the algorithm measured fastest at the nearest size (MPICH)")
    grad_compression: str = _f("none", "compress the gradient reduction across nodes "
                                       "(hierarchical) or over dp x sp (flat): int8 with "
                                       "per-block scales both ways, or topk values + indices",
                               choices=("none", "int8", "topk"))
    topk_ratio: float = _f(0.01, "--grad-compression topk: fraction of each bucket's elements "
                                 "sent")
    error_feedback: str = _f("on", "keep what compression did not send and add it to the next "
                                   "step's gradient (saved in checkpoints)", choices=("on", "off"))
    topk_catch_up: str = _f("on", "--grad-compression topk with error feedback: AdamW moves a "
                                  "coordinate when its gradient arrives, by the steps it "
                                  "waited (moments decayed that many steps toward the mean "
                                  "gradient); off: one AdamW step on the arriving sum, as if "
                                  "it were one step's gradient",
                            choices=("on", "off"))
    compression_warmup: int = _f(-1, "--grad-compression: steps reduced uncompressed before "
                                     "compression starts (the warm-up of Deep Gradient "
                                     "Compression and 1-bit Adam: the first steps move the model "
                                     "most, and compression delays what it does not send); -1: "
                                     "the codec's default share of --steps (int8 a tenth, topk "
                                     "a third: what converges on the default run, "
                                     "docs/benchmarks.md); 0: compress from the first step")
    reduce_dtype: str = _f("float32", "dtype of the gradients the dp x sp reduction sends: "
                                      "float32 (the gradients' own: float32, float64 in a "
                                      "float64 run) or bfloat16 (--dtype bfloat16 only: half "
                                      "the bytes, summed in float32 arithmetic and rounded to "
                                      "bf16 at each step of the reduction)",
                           choices=("float32", "bfloat16"))
    ep: int = _f(1, "expert-parallel size (--moe-experts): each group of ep consecutive ranks "
                    "of dp x sp splits the experts, tokens sent to their experts' ranks by "
                    "all-to-all")
    ep_overlap: bool = _f(True, "ep > 1: the tokens' all-to-all-v there and back are "
                                "non-blocking, each rank computing its own tokens' experts (and "
                                "the shared expert, the weight gradients) while they travel "
                                "(--no-ep-overlap: blocking; the same bits and bytes)",
                          flag="--no-ep-overlap")
    tp_sequence_parallel: bool = _f(False, "Megatron sequence parallelism inside TP: norms, "
                                           "residuals and pipeline messages hold 1/tp of the "
                                           "tokens (all-gather / reduce-scatter replace the "
                                           "all-reduces)")
