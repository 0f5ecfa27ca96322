"""The training run's fields (``[train]``): data, batch, optimiser, schedule, numerics,
output; the step sets of ``--trace-steps``; what a resumed run keeps from its checkpoint."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from mpipar.config.schema import ConfigError, described as _f, positive, require
from mpipar.model.recompute import RECOMPUTE_MODES, Recompute


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
    cpu_bf16_gemm: str = _f("auto", "bf16 GEMMs of the linears on the CPU (--dtype bfloat16): "
                                    "mkl (oneMKL's cblas_gemm_bf16bf16f32: bf16 operands, "
                                    "float32 accumulation; fast on AMX-BF16 or AVX512-BF16 "
                                    "CPUs; the [cpu-bf16] extra), float32 (the operands "
                                    "upcast, NumPy's float32 BLAS), auto (mkl where the CPU "
                                    "reports amx_bf16 or avx512_bf16 and MKL loads, else "
                                    "float32)", choices=("auto", "mkl", "float32"))
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
    pack_pairs: bool = _f(False, "DPO: pack the pairs with document masking: a microbatch of "
                                 "m pairs is m rows of --seq-len, a pair's two sequences side "
                                 "by side in one row, each its own document (attention and "
                                 "RoPE positions restart at it), the pairs laid in order, "
                                 "several to a row where they fit; a pair whose two sequences "
                                 "take more than --seq-len tokens is refused")
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
    state_copies: int = _f(0, "with --on-rank-failure shrink: keep a copy of every rank's share "
                              "of the training state on a partner rank (on another node when "
                              "there are several), refreshed each step, so a lost rank's state "
                              "is restored from the survivors' memory under any layout (0: "
                              "only dp replicas of the whole state recover from memory; "
                              "1: one copy, survives the loss of a rank or of a node)")
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
                           "(PEFT's target_modules): a comma list of those the model has: "
                           "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; "
                           "latent attention's q_a_proj, q_b_proj (q_proj without a query "
                           "latent), kv_a_proj_with_mqa, kv_b_proj, o_proj; a mixture of "
                           "experts' routed experts as experts.gate_up_proj, "
                           "experts.down_proj (PEFT's target_parameters mlp.experts.*; "
                           "gate_proj, up_proj, down_proj refused on such a model)")
    lora_dropout: float = _f(0.0, "LoRA: dropout probability on the adapters' input, training "
                                  "only (PEFT's lora_dropout; in [0, 1))")
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
    def sequences_per_sample(self) -> int:
        """Sequences the model runs per sample of the batch: 1, or a DPO pair's 2 (its chosen
        and rejected responses, :mod:`mpipar.training.objective`)."""
        return 2 if self.objective == "dpo" else 1

    @property
    def rows_per_sample(self) -> int:
        """Rows of ``seq_len`` the model runs per sample of the batch: a sequence each, or
        under ``pack_pairs`` one a pair (a microbatch of m pairs packed into m rows,
        :func:`mpipar.data.preference.pack_pairs`)."""
        return 1 if self.pack_pairs else self.sequences_per_sample

    @property
    def recompute_mode(self) -> Recompute:
        """The :class:`~mpipar.model.recompute.Recompute` mode ``recompute`` names."""
        return Recompute.named(self.recompute)


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


def check_trace_steps(spec: str, steps: int) -> None:
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


def check_train(t: TrainConfig) -> None:
    """The training fields' own rules (ranges; what one field asks of another)."""
    positive(t, ("seq_len", "global_batch_size"), "train")
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
    check_trace_steps(t.trace_steps, t.steps)
    for item in filter(None, t.dump_activations.split(",")):
        require(item.strip().isdigit() and int(item) >= 1,
                f"train.dump_activations={t.dump_activations!r}: must be a comma-separated "
                f"list of step numbers >= 1")
