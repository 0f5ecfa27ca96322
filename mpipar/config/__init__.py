"""Configuration: model, parallel layout and training, from TOML with CLI overrides.

Every field carries its documentation and its command-line flag in the dataclass metadata, so
``python -m mpipar.train --help``, the TOML file and docs/configuration.md all describe the same
thing.
A TOML config has up to three tables, ``[model]``, ``[parallel]`` and ``[train]``, whose keys are
the field names below. Command-line flags override the file; ``validate`` checks every rule
before any communication happens.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

import tomli_w

from mpipar.model.recompute import RECOMPUTE_MODES, Recompute
from mpipar.model.rope import ROPE_TYPES, RopeScaling
from mpipar.parallel.sequence.names import SP_MODE_HELP, sp_mode_help


class ConfigError(ValueError):
    """A configuration value breaks a rule; the message names the field, the value and the rule."""


@dataclass(frozen=True)
class LayerSet:
    """A set of blocks as a layer-set field writes it (``window_layers``, ``moe_layers``):
    ``all``, ``even`` (blocks 0, 2, ...), ``odd``, or a comma list of block indices (``listed``).
    :meth:`parse` is the one reader of that grammar; the model asks the set."""

    kind: str                                  # all, even, odd or list
    listed: frozenset[int] = frozenset()

    KEYWORDS = ("all", "even", "odd")

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def parse(text: str, name: str, layers: int) -> LayerSet:
        """The set ``text`` names in a model of ``layers`` blocks; ConfigError names the field
        ``model.<name>``, the value and the rule."""
        spec = text.strip()
        if spec in LayerSet.KEYWORDS:
            return LayerSet(spec)
        items = [x.strip() for x in spec.split(",")]
        require(all(re.fullmatch(r"[0-9]+", x) and int(x) < layers for x in items),
                f"model.{name}={text!r}: must be all, even, odd or a comma list of layer "
                f"indices in [0, {layers})")
        return LayerSet("list", frozenset(int(x) for x in items))

    @property
    def every_layer(self) -> bool:
        """Whether the set is written ``all`` (every block, whatever the model's depth)."""
        return self.kind == "all"

    def contains(self, layer: int) -> bool:
        """Whether block ``layer`` is in the set."""
        if self.kind == "list":
            return layer in self.listed
        return self.kind == "all" or layer % 2 == (self.kind == "odd")

    def count(self, start: int, stop: int) -> int:
        """How many of the blocks ``[start, stop)`` are in the set, without a per-block walk."""
        if self.kind == "list":
            return sum(start <= i < stop for i in self.listed)
        odd = stop // 2 - start // 2
        return {"all": stop - start, "even": (stop - start) - odd, "odd": odd}[self.kind]

    def layers(self, n: int) -> list[int]:
        """The set's blocks of a model of ``n`` blocks, in order."""
        return [i for i in range(n) if self.contains(i)]


def _f(default: Any, help: str, flag: str | None = None, choices: tuple | None = None,
       **kw: Any) -> Any:
    meta = {"help": help, "flag": flag, "choices": choices, **kw}
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    """Shape of the Llama decoder (names follow Hugging Face ``LlamaConfig`` where they map)."""

    vocab_size: int = _f(256, "vocabulary size (256 = byte-level tokens)")
    hidden: int = _f(128, "model width (hidden_size)")
    layers: int = _f(4, "number of decoder blocks")
    heads: int = _f(4, "query heads")
    kv_heads: int = _f(2, "key/value heads (grouped-query attention); must divide heads")
    head_dim: int = _f(0, "width of one head; 0 means hidden // heads")
    ffn_hidden: int = _f(0, "SwiGLU inner width; 0 means 8/3 * hidden rounded up to a multiple of 32")
    rope_theta: float = _f(10000.0, "RoPE base frequency theta")
    rope_type: str = _f("default", "RoPE frequency scaling (transformers' rope_type): default "
                                   "(none), linear (frequencies / rope_factor), dynamic (NTK: "
                                   "theta grows for sequences longer than "
                                   "rope_original_max_positions), llama3 (Llama 3.1's "
                                   "low/high-frequency rule)",
                        choices=ROPE_TYPES)
    rope_factor: float = _f(1.0, "RoPE scaling factor (linear, dynamic, llama3); 1 with default")
    rope_low_freq_factor: float = _f(1.0, "llama3 RoPE: frequencies whose wavelength exceeds "
                                          "rope_original_max_positions / this are divided by "
                                          "rope_factor")
    rope_high_freq_factor: float = _f(4.0, "llama3 RoPE: frequencies whose wavelength is below "
                                           "rope_original_max_positions / this are kept (those "
                                           "between the two bounds are interpolated)")
    rope_original_max_positions: int = _f(0, "pretraining context of a scaled RoPE (llama3: "
                                             "original_max_position_embeddings; dynamic: "
                                             "max_position_embeddings)")
    tie_embeddings: bool = _f(False, "the LM head is the embedding matrix: one parameter "
                                     "(tie_word_embeddings), a copy on the first and the last "
                                     "pipeline stage whose gradients are summed")
    attention_bias: bool = _f(False, "q, k and v projections have biases (Qwen2)")
    qk_norm: bool = _f(False, "RMSNorm over each head's queries and keys before RoPE, one "
                              "weight of head_dim for all query heads and one for all key "
                              "heads (Qwen3's q_norm and k_norm)")
    norm_eps: float = _f(1e-5, "RMSNorm epsilon")
    init_std: float = _f(0.02, "standard deviation of the normal weight initialisation")
    sliding_window: int = _f(0, "sliding-window attention: a token sees itself and the W-1 "
                                "tokens before it (Mistral's sliding_window); 0 = full causal")
    window_layers: str = _f("all", "the layers that use --sliding-window: all, even (layers 0, 2, "
                                   "... local, the others global, as Gemma 2), odd, or a comma "
                                   "list of layer indices")

    moe_experts: int = _f(0, "mixture of experts: routed experts per sparse layer (Mixtral's "
                             "num_local_experts); 0 = dense model")
    moe_top_k: int = _f(2, "mixture of experts: experts each token is routed to "
                           "(num_experts_per_tok)")
    moe_ffn_hidden: int = _f(0, "mixture of experts: SwiGLU inner width of one expert; 0 means "
                                "ffn_hidden")
    moe_layers: str = _f("all", "mixture of experts: the sparse layers (all, even, odd, or a "
                                "comma list of layer indices); the others keep the dense FFN")
    moe_aux_loss_coef: float = _f(0.001, "mixture of experts: coefficient alpha of DeepSeek-V3's "
                                         "sequence-wise balance loss (0 turns it off)")
    moe_bias_update_rate: float = _f(0.0, "mixture of experts: DeepSeek-V3's auxiliary-loss-free "
                                          "balancing: a per-expert bias added to the router's "
                                          "probabilities for the top-K choice only, moved by "
                                          "rate x sign(mean load - load) after each step (0: off)")
    moe_capacity_factor: float = _f(0.0, "mixture of experts: expert capacity C per sequence: in "
                                         "each row of T tokens an expert takes at most "
                                         "ceil(C T K / E) of its assignments, the earliest "
                                         "positions first, the rest dropped (0: dropless)")
    moe_shared_ffn_hidden: int = _f(0, "mixture of experts: SwiGLU inner width of a shared expert "
                                       "(DeepSeek-V3's, ungated) every token runs beside its "
                                       "routed ones in each sparse layer; 0 = none")
    moe_shared_gate: bool = _f(False, "mixture of experts: scale the shared expert's output per token "
                                      "by sigmoid(x w_g) (Qwen2-MoE's shared_expert_gate)")
    moe_norm_topk: bool = _f(True, "mixture of experts: renormalise the top-K router probabilities "
                                   "to sum to 1 (Mixtral's; --no-moe-norm-topk: the K softmax "
                                   "probabilities as they are, Qwen2-MoE's norm_topk_prob false)",
                             flag="--no-moe-norm-topk")

    def sparse_set(self) -> LayerSet:
        """The blocks ``moe_layers`` names (whether or not ``moe_experts`` makes them sparse)."""
        return LayerSet.parse(self.moe_layers, "moe_layers", self.layers)

    def window_set(self) -> LayerSet:
        """The blocks ``window_layers`` names (whether or not ``sliding_window`` is set)."""
        return LayerSet.parse(self.window_layers, "window_layers", self.layers)

    @property
    def rope(self) -> RopeScaling:
        """The :class:`~mpipar.model.rope.RopeScaling` ``rope_type`` names."""
        return RopeScaling.named(self.rope_type)

    def is_sparse(self, layer: int) -> bool:
        """Whether block ``layer``'s FFN is a mixture of experts (``moe_experts`` > 0 and
        ``moe_layers`` names it)."""
        return self.moe_experts > 0 and self.sparse_set().contains(layer)

    def sparse_layers(self) -> int:
        """How many blocks :meth:`is_sparse` names, without a per-layer walk."""
        return self.sparse_set().count(0, self.layers) if self.moe_experts else 0

    def layer_window(self, layer: int) -> int:
        """The sliding window of block ``layer``: ``sliding_window`` if ``window_layers`` names
        the layer, else 0 (full causal attention)."""
        if self.sliding_window == 0:
            return 0
        return self.sliding_window if self.window_set().contains(layer) else 0

    def windows(self) -> list[int]:
        """The sliding window of every layer (0: full causal), in layer order."""
        return [self.layer_window(i) for i in range(self.layers)]


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
                                  choices=("auto", "ring", "tree", "rabenseifner", "hierarchical"))
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


@dataclass
class TrainConfig:
    """The optimisation run: data, batch, optimiser, schedule, numerics, output."""

    steps: int = _f(50, "total optimizer steps")
    seq_len: int = _f(128, "tokens per sequence")
    global_batch_size: int = _f(16, "sequences per optimizer step, over all data-parallel ranks")
    micro_batch_size: int = _f(0, "sequences per microbatch on one DP rank; 0 means one microbatch "
                                  "(global_batch_size // dp)")
    lr: float = _f(3e-3, "peak learning rate")
    min_lr: float = _f(3e-4, "final learning rate of the cosine and wsd schedules")
    lr_schedule: str = _f("cosine", "learning-rate schedule after the warm-up: constant (lr), "
                                    "cosine (from lr to min_lr over the remaining steps), wsd "
                                    "(warmup-stable-decay: lr until the last --decay-fraction "
                                    "of the steps, which decay to min_lr; resuming a checkpoint "
                                    "of the stable phase with more --steps extends the run)",
                          choices=("constant", "cosine", "wsd"))
    decay_fraction: float = _f(0.0, "--lr-schedule wsd: the fraction F in (0, 1] of the steps "
                                    "that decays (the last F * steps, rounded, at least one); "
                                    "0 with the other schedules")
    decay_shape: str = _f("linear", "--lr-schedule wsd: how the decay falls from lr to min_lr "
                                    "with progress p in (0, 1]: linear (1 - p), cosine "
                                    "((1 + cos(pi p)) / 2) or sqrt (1 - sqrt(p), the WSD papers' "
                                    "cool-down)", choices=("linear", "cosine", "sqrt"))
    warmup_steps: int = _f(5, "linear warm-up steps")
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay (parameters with >= 2 dims only)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    clip_grad: float = _f(1.0, "clip gradients to this global L2 norm; <= 0 disables clipping")
    optimizer: str = _f("adamw", "adamw, or muon: the decoder blocks' matrices orthogonalised "
                                 "(torch.optim.Muon), AdamW for the rest", choices=("adamw", "muon"))
    muon_momentum: float = _f(0.95, "Muon momentum, in [0, 1)")
    muon_ns_steps: int = _f(5, "Muon's Newton-Schulz iterations, >= 1")
    muon_nesterov: bool = _f(True, "Muon's Nesterov update (--no-muon-nesterov: the momentum "
                                   "buffer itself)", flag="--no-muon-nesterov")
    muon_adjust_lr: str = _f("original", "Muon's lr per matrix: original (x sqrt(max(1, rows / "
                                         "cols))) or match_rms_adamw (x 0.2 sqrt(max(rows, cols)))",
                             choices=("original", "match_rms_adamw"))
    dtype: str = _f("float32", "compute dtype: float32 or float64 (parameters, gradients, "
                               "optimizer state and activations all in it), or bfloat16 (mixed "
                               "precision: bf16 compute copies of the parameters, activations "
                               "and messages; float32 master weights, gradients, AdamW "
                               "moments, statistics and loss)",
                    choices=("float32", "float64", "bfloat16"))
    backend: str = _f("auto", "kernel backend: auto (cupy on a CUDA device, else numba, else "
                              "numpy), numba or numpy (CPU), cupy (--device cuda)",
                      choices=("auto", "numpy", "numba", "cupy"))
    attention_backend: str = _f("auto", "bf16 attention on a CUDA device: cudnn (cuDNN's fused "
                                        "attention through its frontend), mpipar (mpipar's "
                                        "FA2-style kernel), auto (cuDNN where it imports and "
                                        "takes the case, else mpipar's); float32/float64 and "
                                        "the CPU use mpipar's exact kernels",
                                choices=("auto", "cudnn", "mpipar"))
    device: str = _f("cpu", "where parameters, gradients, optimizer state and activations live: "
                            "cpu, cuda (rank r takes GPU local_rank mod visible GPUs; ranks may "
                            "share one), auto (cuda when CuPy sees a device)",
                     choices=("cpu", "cuda", "auto"))
    cuda_aware_mpi: str = _f("auto", "how arrays reach MPI: on (device buffers straight to a "
                                     "CUDA-aware MPI; refused when the library does not report "
                                     "CUDA support), off (staged through reusable host "
                                     "buffers, on the CPU too), auto (straight when the "
                                     "library is CUDA-aware or the arrays are on the host); "
                                     "env MPIPAR_CUDA_AWARE_MPI=1/0 overrides the library's "
                                     "answer", choices=("auto", "on", "off"))
    data: str = _f("", "token data: a text file or directory, .bin (uint16), .npy, .h5; "
                       "empty = the embedded Python-stdlib corpus")
    shuffle: bool = _f(True, "shuffle samples each epoch (--no-shuffle: step k uses samples k*B..(k+1)*B-1)",
                       flag="--no-shuffle")
    eval_data: str = _f("", "validation token data (the formats of --data), never trained on; "
                            "empty: none, or --eval-fraction")
    eval_fraction: float = _f(0.0, "hold out the last fraction of the training data's samples "
                                   "for validation (training never draws them; a resumed run "
                                   "keeps the checkpoint's)")
    eval_every: int = _f(0, "validation loss every N steps and after the last step (0: after the "
                            "last step only, when a validation set is given)")
    eval_batches: int = _f(4, "validation batches of global_batch_size sequences, evenly spaced "
                              "over the validation samples, the same at every evaluation")
    seed: int = _f(1234, "seed for initialisation and data order")
    document_masking: bool = _f(False, "packed documents: a token attends only to earlier tokens "
                                       "of its own document (documents end at the EOS token, "
                                       "which belongs to the document it ends) and RoPE "
                                       "positions restart at 0 at each document start")
    eos_token_id: int = _f(-1, "the end-of-text token of --document-masking and "
                               "--eod-mask-loss; -1: the EOS recorded by data prepare "
                               "--tokenizer (byte data records none: give it)")
    loss_mask: bool = _f(False, "SFT: train on the completion tokens only (the loss_mask "
                                "stream of data prepare --sft); the loss is the mean over the "
                                "counted targets of the global batch")
    eod_mask_loss: bool = _f(False, "targets at positions whose input is the EOS token carry "
                                    "no loss; the loss is the mean over the counted targets of "
                                    "the global batch")
    objective: str = _f("tokens", "what training minimises: the next-token loss, or DPO over "
                                  "the preference pairs of data prepare --preference "
                                  "(--global-batch-size and --micro-batch-size count pairs)",
                        choices=("tokens", "dpo"))
    dpo_beta: float = _f(0.1, "DPO: the temperature beta of the rewards beta * (log pi - "
                              "log pi_ref); > 0")
    run_dir: str = _f("runs/mpipar", "output directory (config.toml, metrics.jsonl)")
    log_every: int = _f(10, "print a progress line every N steps (0: never)")
    save_dir: str = _f("", "checkpoint directory (step_NNNNNNNN/ per checkpoint, plus `latest`); "
                           "empty: RUN_DIR/checkpoints")
    save_every: int = _f(0, "save a checkpoint every N steps (0: only at the end, if save_dir is set)")
    keep_last: int = _f(0, "keep only the newest K checkpoints after each commit (0: keep all)")
    async_save: bool = _f(False, "checkpoints every --save-every steps are copied to host memory "
                                 "at the step boundary and written by a background thread while "
                                 "training goes on; committed at a later step boundary")
    trace_steps: str = _f("", "steps whose events go to RUN_DIR/trace.json (Chrome trace format, "
                              "ui.perfetto.dev): a number N (steps 1..N), a range 'A-B' or a "
                              "list '3,5'; empty: none")
    resume: str = _f("", "resume from 'auto' (the newest checkpoint in save_dir that verifies; "
                         "none saved yet: start fresh; saved but none verifies: refused) or a "
                         "checkpoint path; model settings then come from it")
    reset_optimizer: bool = _f(False, "with --resume: the parameters only, the optimizer state "
                                      "starts afresh (how a run resumes under another --optimizer)")
    dump_activations: str = _f("", "steps whose chunk activations every rank writes to "
                                    "RUN_DIR/activations/step_N/rank_R.h5, e.g. '1,100'")
    recompute: str = _f("none", "activation memory: none, selective (attention internals), full "
                                "(whole blocks from their inputs), offload (to a per-rank HDF5 file)",
                        choices=RECOMPUTE_MODES)
    on_nan: str = _f("stop", "a non-finite loss or gradient norm: skip the step, or stop with a "
                             "checkpoint", choices=("stop", "skip"))
    on_rank_failure: str = _f("abort", "a rank that dies: abort the job, or shrink (needs an MPI "
                                       "with ULFM: the survivors drop it and train on from the "
                                       "last consistent state, the global batch kept)",
                              choices=("abort", "shrink"))
    collective_timeout: float = _f(0.0, "abort a run stuck this many seconds in one collective, "
                                        "naming the operation and group (0: off)")
    startup_timeout: float = _f(600.0, "with --collective-timeout: the limit until step 1 has "
                                       "finished (start-up, checkpoint load, kernel compilation "
                                       "and first touch of memory in step 1), if larger")
    allow_oversubscribed_memory: bool = _f(False, "start even when the planner's memory of a rank "
                                                  "exceeds its share of the node's available "
                                                  "memory")
    init_from_hf: str = _f("", "start from a Hugging Face Llama, Qwen2 or Mistral directory "
                               "(config.json + "
                               "safetensors); model settings then come from it")
    hf_untie_embeddings: bool = _f(False, "with --init-from-hf of a tied checkpoint: untie the "
                                          "LM head (it starts as a copy of the embedding and "
                                          "trains apart); default: keep them tied")
    lora_rank: int = _f(0, "LoRA: train low-rank adapters of this rank on the --lora-targets "
                           "linears, the base weights frozen (no gradient, no optimizer state, "
                           "no reduction); 0: train every parameter")
    lora_alpha: float = _f(16.0, "LoRA: the adapters' scale is alpha / rank (alpha / sqrt(rank) "
                                 "with --lora-rslora)")
    lora_targets: str = _f("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                           "LoRA: the linears that carry adapters, by Hugging Face module name "
                           "(PEFT's target_modules): a comma list of q_proj, k_proj, v_proj, "
                           "o_proj, gate_proj, up_proj, down_proj")
    lora_dropout: float = _f(0.0, "LoRA: dropout on the adapters' input (only 0 is supported)")
    lora_rslora: bool = _f(False, "LoRA: rank-stabilised scale alpha / sqrt(rank) (PEFT's "
                                  "use_rslora)")
    init_adapter: str = _f("", "LoRA: start the adapters from a PEFT adapter directory "
                               "(adapter_config.json + adapter_model.safetensors)")
    export_adapter: str = _f("", "LoRA: write the trained adapters as a PEFT adapter directory "
                                 "at the end (peft.PeftModel.from_pretrained loads it)")
    export_hf: str = _f("", "write the trained weights as a Hugging Face directory at the end "
                            "(Llama; Qwen2 when the model has attention biases; Mistral with "
                            "a sliding window on every layer)")
    export_dtype: str = _f("", "dtype of --export-hf (empty: the training dtype)",
                           choices=("", "float16", "bfloat16", "float32", "float64"))
    tensorboard: str = _f("", "TensorBoard event directory for every metrics.jsonl number ('off': "
                              "none); empty: RUN_DIR/tensorboard when the [tensorboard] extra is "
                              "installed, else none")

    @property
    def recompute_mode(self) -> Recompute:
        """The :class:`~mpipar.model.recompute.Recompute` mode ``recompute`` names."""
        return Recompute.named(self.recompute)


@dataclass
class Config:
    """The whole resolved configuration of a run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    SECTIONS = ("model", "parallel", "train")

    # ------------------------------------------------------------------ I/O
    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {s: dataclasses.asdict(getattr(self, s)) for s in self.SECTIONS}

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "Config":
        cfg = cls()
        for section, values in data.items():
            if section not in cls.SECTIONS:
                raise ConfigError(f"{source}: unknown table [{section}]; known tables: "
                                  f"{', '.join(cls.SECTIONS)}")
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: [{section}] must be a table")
            _set_fields(getattr(cfg, section), values, f"{source}: {section}")
        return cfg

    @classmethod
    def from_toml(cls, path: str) -> "Config":
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"--config {path}: file not found") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None
        except OSError as exc:
            raise ConfigError(f"--config {path}: cannot be read ({exc.strerror or exc})") from None
        return cls.from_dict(data, source=path)

    # ------------------------------------------------------------ validation
    @property
    def dump_steps(self) -> set[int]:
        """The steps listed in ``train.dump_activations``."""
        return {int(x) for x in self.train.dump_activations.split(",") if x.strip()}


def _check_moe(m: ModelConfig) -> None:
    """The mixture-of-experts fields' own rules."""
    require(m.moe_experts >= 0, f"model.moe_experts={m.moe_experts}: must be >= 0 (0: dense)")
    require(m.moe_shared_ffn_hidden >= 0, f"model.moe_shared_ffn_hidden="
            f"{m.moe_shared_ffn_hidden}: must be >= 0 (0: no shared expert)")
    require(m.moe_shared_ffn_hidden == 0 or m.moe_experts > 0,
            f"model.moe_shared_ffn_hidden={m.moe_shared_ffn_hidden}: needs a mixture of experts "
            f"(--moe-experts > 0)")
    require(not m.moe_shared_gate or m.moe_shared_ffn_hidden > 0,
            f"model.moe_shared_gate={m.moe_shared_gate}: needs a shared expert "
            f"(--moe-shared-ffn-hidden > 0)")
    require(m.moe_norm_topk or m.moe_experts > 0,
            f"model.moe_norm_topk={m.moe_norm_topk}: needs a mixture of experts "
            f"(--moe-experts > 0)")
    if m.moe_experts == 0:
        return
    require(1 <= m.moe_top_k <= m.moe_experts,
            f"model.moe_top_k={m.moe_top_k}: must be in [1, moe_experts={m.moe_experts}]")
    require(m.moe_ffn_hidden > 0, f"model.moe_ffn_hidden={m.moe_ffn_hidden}: must be >= 0")
    require(m.moe_aux_loss_coef >= 0,
            f"model.moe_aux_loss_coef={m.moe_aux_loss_coef}: must be >= 0")
    m.sparse_set()                  # moe_layers parses: ConfigError names the value and the rule


def check_fields(cfg: Config, m: ModelConfig) -> None:
    """The fields' own rules (ranges, choices, what one field asks of another in its section);
    ``m`` is ``cfg.model`` with its derived defaults filled in (:func:`mpipar.layout.resolve_model`).
    The rules that involve what a component does with the values live with that component and
    are asked, in order, by :func:`mpipar.rules.validate`. Raises ConfigError naming the field,
    the value and the rule (the first violation)."""
    p, t = cfg.parallel, cfg.train
    for obj, section in ((cfg.model, "model"), (p, "parallel"), (t, "train")):
        _representable(obj, section)
    # choices first: the rules below read modes (m.rope, ...) that resolve a field's name
    for obj, section in ((m, "model"), (p, "parallel"), (t, "train")):
        for f in fields(obj):
            choices = f.metadata.get("choices")
            value = getattr(obj, f.name)
            require(not choices or value in choices,
                    f"{section}.{f.name}={value!r}: must be one of "
                    f"{', '.join(map(str, choices or ()))}")
    _positive(m, ("vocab_size", "hidden", "layers", "heads", "kv_heads", "head_dim",
                  "ffn_hidden"), "model")
    require(m.vocab_size >= 2, f"model.vocab_size={m.vocab_size}: must be at least 2")
    require(cfg.model.head_dim != 0 or m.hidden % m.heads == 0,
            f"model.hidden={m.hidden}: must be divisible by model.heads={m.heads} "
            f"(or set model.head_dim)")
    require(m.head_dim % 2 == 0, f"model.head_dim={m.head_dim}: must be even (RoPE rotates pairs)")
    require(m.heads % m.kv_heads == 0,
            f"model.kv_heads={m.kv_heads}: must divide model.heads={m.heads}")
    require(m.rope_theta > 0, f"model.rope_theta={m.rope_theta}: must be > 0")
    _check_rope_scaling(m)
    require(m.norm_eps > 0, f"model.norm_eps={m.norm_eps}: must be > 0")
    require(m.init_std > 0, f"model.init_std={m.init_std}: must be > 0")
    _check_window(m)
    _check_moe(m)

    _positive(p, ("tp", "pp", "sp", "virtual_stages"), "parallel")
    require(p.dp >= 0, f"parallel.dp={p.dp}: must be >= 0 (0 fills the world)")

    _positive(t, ("seq_len", "global_batch_size"), "train")
    require(t.steps >= 0, f"train.steps={t.steps}: must be >= 0")
    require(t.micro_batch_size >= 0, f"train.micro_batch_size={t.micro_batch_size}: must be >= 0")
    require(t.seed >= 0, f"train.seed={t.seed}: must be >= 0")
    require(t.log_every >= 0, f"train.log_every={t.log_every}: must be >= 0")
    require(t.save_every >= 0, f"train.save_every={t.save_every}: must be >= 0")
    require(t.keep_last >= 0, f"train.keep_last={t.keep_last}: must be >= 0")
    require(not t.save_every or t.save_dir,
            f"train.save_every={t.save_every}: needs --save-dir")
    require(t.resume != "auto" or t.save_dir, "train.resume='auto': needs --save-dir")
    require(t.collective_timeout >= 0,
            f"train.collective_timeout={t.collective_timeout}: must be >= 0")
    require(t.startup_timeout >= 0, f"train.startup_timeout={t.startup_timeout}: must be >= 0")
    require(t.lora_rank >= 0, f"train.lora_rank={t.lora_rank}: must be >= 0 (0: no LoRA)")
    require(t.lora_alpha > 0, f"train.lora_alpha={t.lora_alpha}: must be > 0")
    for name in ("init_adapter", "export_adapter"):
        require(t.lora_rank > 0 or not getattr(t, name),
                f"train.{name}={getattr(t, name)!r}: needs LoRA (--lora-rank > 0)")
    _check_trace_steps(t.trace_steps, t.steps)
    for item in filter(None, t.dump_activations.split(",")):
        require(item.strip().isdigit() and int(item) >= 1,
                f"train.dump_activations={t.dump_activations!r}: must be a comma-separated "
                f"list of step numbers >= 1")


def require(ok: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` (field, value and rule) unless ``ok``."""
    if not ok:
        raise ConfigError(message)


def _check_window(m: ModelConfig) -> None:
    """``sliding_window`` is >= 0; ``window_layers`` is all, even, odd or a list of layers."""
    require(m.sliding_window >= 0,
            f"model.sliding_window={m.sliding_window}: must be >= 0 (0 = full causal)")
    m.window_set()                  # window_layers parses: ConfigError names the value and the rule


INT_LIMIT = 2**63
"""Integer fields must lie in (-2**63, 2**63): they are stored as 64-bit HDF5 attributes in
checkpoints and used as NumPy int64 values."""


def _representable(obj: Any, section: str) -> None:
    """Every float field of ``obj`` is finite and every int field fits in 64 bits."""
    for f in fields(obj):
        value, kind = getattr(obj, f.name), str(f.type)
        if kind == "float":
            require(math.isfinite(value), f"{section}.{f.name}={value}: must be a finite number")
        elif kind == "int":
            require(-INT_LIMIT < value < INT_LIMIT,
                    f"{section}.{f.name}={value}: must lie in (-2**63, 2**63)")


def _check_rope_scaling(m: ModelConfig) -> None:
    """The RoPE scaling fields' own rules (a factor only with a scaling type; llama3's bounds)."""
    rope = m.rope
    if not rope.scales:
        require(m.rope_factor == 1.0,
                f"model.rope_factor={m.rope_factor}: scales only with model.rope_type linear, "
                f"dynamic or llama3 (rope_type is {m.rope_type!r})")
    require(m.rope_factor > 0, f"model.rope_factor={m.rope_factor}: must be > 0")
    require(m.rope_original_max_positions >= 0,
            f"model.rope_original_max_positions={m.rope_original_max_positions}: must be >= 0")
    if rope.pretraining_context:
        require(m.rope_original_max_positions >= 1,
                f"model.rope_original_max_positions={m.rope_original_max_positions}: "
                f"rope_type {m.rope_type!r} needs the pretraining context (>= 1)")
    if rope.frequency_band:
        require(0 < m.rope_low_freq_factor < m.rope_high_freq_factor,
                f"model.rope_low_freq_factor={m.rope_low_freq_factor}, "
                f"model.rope_high_freq_factor={m.rope_high_freq_factor}: llama3 RoPE needs "
                f"0 < low < high")


def _positive(obj: Any, names: tuple[str, ...], section: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value >= 1, f"{section}.{name}={value}: must be a positive integer")


def _set_fields(obj: Any, values: dict[str, Any], where: str) -> None:
    known = {f.name: f for f in fields(obj)}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"{where}.{key}: unknown field; known: {', '.join(known)}")
        setattr(obj, key, _coerce(value, known[key], f"{where}.{key}"))


def _coerce(value: Any, f: dataclasses.Field, where: str) -> Any:
    kind = f.type if isinstance(f.type, type) else {"int": int, "float": float, "str": str,
                                                     "bool": bool}[str(f.type)]
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={value!r}: must be true or false")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={value!r}: must be an integer")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}={value!r}: must be a number")
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"{where}={value}: too large for a floating-point number") from None
    if not isinstance(value, str):
        raise ConfigError(f"{where}={value!r}: must be a string")
    if "\0" in value:  # TOML can spell one ("\u0000"); no path or name holds it
        raise ConfigError(f"{where}={value[:80]!r}: must not contain a NUL character")
    return value


# ------------------------------------------------------------------------------ CLI
@dataclasses.dataclass(frozen=True)
class StepRanges:
    """Steps held as inclusive ranges ``(first, last)``, never listed one by one: a range of
    10**20 steps costs two integers. ``step in ranges``; ``last`` the highest step (0: none)."""
    ranges: tuple[tuple[int, int], ...] = ()

    def __contains__(self, step: object) -> bool:
        return any(lo <= step <= hi for lo, hi in self.ranges)

    def __bool__(self) -> bool:
        return bool(self.ranges)

    @property
    def last(self) -> int:
        return max((hi for _, hi in self.ranges), default=0)


def trace_step_set(spec: str) -> StepRanges:
    """The steps ``--trace-steps`` names: ``N`` steps 1..N, ``A-B`` steps A..B, ``a,b,...``
    those steps (items may be ranges); empty: none. ValueError on anything else."""
    spec = spec.strip()
    if not spec:
        return StepRanges()
    if spec.isdigit():
        return StepRanges(((1, int(spec)),) if int(spec) else ())
    out = []
    for item in spec.split(","):
        lo, dash, hi = item.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(item)
        a, b = int(lo), int(hi or lo)
        if not 1 <= a <= b:
            raise ValueError(item)
        out.append((a, b))
    return StepRanges(tuple(out))


def _check_trace_steps(spec: str, steps: int) -> None:
    """A step past ``--steps`` would never run, so its trace would never be written: refused."""
    try:
        last = trace_step_set(spec).last
    except ValueError:
        raise ConfigError(f"train.trace_steps={spec!r}: must be a step count N (steps 1..N), a "
                          f"range A-B or a comma-separated list of steps and ranges, steps "
                          f">= 1") from None
    if last > steps:
        raise ConfigError(f"train.trace_steps={spec!r}: step {last} is past train.steps={steps} "
                          f"(the run's last step): name steps 1..{steps}")


# Model fields a command line may change on a checkpoint: the routing biases' update rate, the
# balance loss's coefficient and the expert capacity are training settings (DeepSeek-V3 sets the
# rate to 0 for its last tokens; a Mixtral checkpoint carries none: its import never reads them).
CHECKPOINT_OVERRIDABLE = ("init_std", "moe_bias_update_rate", "moe_aux_loss_coef",
                          "moe_capacity_factor")


def held_out_from_checkpoint(saved: TrainConfig, given: Mapping[str, Any], source: str) -> float:
    """The ``eval_fraction`` of a run resumed from a checkpoint saved with ``saved``: the
    checkpoint's, so the samples held out for validation stay held out (never trained on). A
    different value in ``given`` (the train fields the user set) is a ConfigError naming both."""
    mine = given.get("eval_fraction")
    if mine is not None and float(mine) != saved.eval_fraction:
        raise ConfigError(
            f"train.eval_fraction={mine!r} (flag --eval-fraction or [train] eval_fraction) "
            f"contradicts {source} (eval_fraction={saved.eval_fraction!r}); the held-out "
            f"split is fixed for a run: drop the setting")
    return saved.eval_fraction
