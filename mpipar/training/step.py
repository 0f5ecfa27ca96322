"""What a run does with a :class:`~mpipar.training.rank.Rank`: train one step, evaluate, read
and write its parameters as global tensors, say where it stands, release it.

``train_step(rank, k)`` runs optimizer step ``k`` (0-based) and returns its
:class:`~mpipar.observe.metrics.StepResult`, identical on every rank. ``evaluate(rank)``
computes the validation loss (:class:`~mpipar.observe.metrics.EvalResult`) under the same
layout, forward only: the schedule's forward-only op list
(:func:`mpipar.parallel.pipeline.schedule.forward_only`), no gradient buffers touched, nothing
kept for a backward, its traffic booked in ``rank.eval_ledger`` (reset at each pass, so
``rank.ledger`` holds exactly a training step's traffic, and each ledger what the planner
predicts for its phase). ``rank.state`` is the rank seen as pieces of global tensors, for
checkpoints (:mod:`mpipar.training.state`); :func:`run_position` is the rest a checkpoint
records (:mod:`mpipar.checkpoint.records`): checkpoints and activation dumps see a rank only
through these.

One step (docs/architecture.md, "One training step through the packages"): this DP rank takes
its rows of the global batch, cuts them into microbatches and this SP rank's sequence chunk
(:mod:`mpipar.training.batches`);
each microbatch runs forward and backward through the stage; gradients are summed over dp x sp
(experts sharded over ep: over ep_dp, :mod:`mpipar.parallel.experts`); the global norm is summed
over tp x pp counting each parameter once; clipping and the optimizer update the local shards.
The loss is the mean over every token of the global batch, whatever the layout. A tied
embedding's copies on the first and last pipeline stage have their gradients summed over
``pp_ends`` by the reducer, count once in the norm, and stay identical.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np

from mpipar.checkpoint.activations import ActivationRecorder, ActivationRegion, dump_step
from mpipar.checkpoint.records import DataCursor, LRScheduleState, RankPlace, RunPosition
from mpipar.checkpoint.shards import require_finite
from mpipar.data.sources import Sampler
from mpipar.model.flops import model_flops_per_step
from mpipar.model.llama import RESIDENT, LlamaStage
from mpipar.model.lora import is_adapter
from mpipar.model.mtp import all_blocks
from mpipar.observe.balance import attention_imbalance, moe_load_stats
from mpipar.observe.metrics import EvalResult, OptimizerCost, StepResult
from mpipar.parallel.pipeline.executor import Microbatch
from mpipar.parallel.placement import expert_of
from mpipar.runtime.comm import booked_to
from mpipar.runtime.device import to_host
from mpipar.training.batches import StepBatch, prepare
from mpipar.training.rank import Rank


def train_step(rank: Rank, step: int) -> StepResult:
    """Run optimizer step ``step`` (0-based) and return its result (the same on every rank)."""
    t0 = time.perf_counter()
    cfg, xp, w, m = rank.cfg, rank.compute.xp, rank.weights, rank.model
    tr = cfg.train
    pref = rank.data.preference
    if pref is not None and pref.reference is None:
        pref.reference = reference_logps(rank)
    batch = prepare(rank, rank.data.sampler, step)
    rows_per = 1 if pref is None else pref.objective.rows_per_pair
    mbs, s_loc = tr.micro_batch_size * rows_per, len(m.positions)
    weight = xp.full((mbs, s_loc), 1.0 / batch.divisor)
    recorder = _start_dump(rank, step)
    w.reducer.start_step(step)
    ready = _grads_ready(rank)
    for ch in m.chunks:
        ch.moe_aux, ch.moe_load, ch.moe_dropped = 0.0, {}, {}
        if ch.mtp is not None:
            ch.mtp.loss = 0.0
    loss = rank.executor.run(rank.params, rank.grads, list(batch.microbatches), m.positions,
                             m.tensor.stream_shape(mbs, s_loc, cfg.model.hidden),
                             rank.compute.dtype, weight,
                             on_ready=None if w.sharded else ready,
                             on_microbatch=_dropout_selector(rank, step))
    w.reducer.finish()
    if recorder is not None:
        for ch in m.chunks:
            ch.recorder = None
        dump_step(recorder, rank_place(rank), _activation_region(rank, step + 1), cfg)
    loss = _global_sum(rank, loss) / batch.divisor
    mtp_loss = (_global_sum(rank, sum((ch.mtp.loss for ch in m.chunks if ch.mtp), 0.0))
                if cfg.model.mtp_depth else None)
    rewards = None if pref is None else _preference_metrics(rank, batch)
    moe, loads = _moe_stats(rank) if cfg.model.moe_experts else (None, None)
    norm_sq = xp.array([w.optimizer.grad_norm_sq(
        lambda name: m.table[name].owned_by(m.tensor.rank, rank.coord.pp))])
    rank.comms.groups["tp_pp"].allreduce_(norm_sq)   # each parameter counted once
    grad_norm = math.sqrt(float(norm_sq[0]))
    lr = w.schedule(step)
    cost = OptimizerCost()
    if math.isfinite(loss) and math.isfinite(grad_norm):
        cost.start(rank.ledger)
        w.optimizer.clip(tr.clip_grad, grad_norm)
        w.optimizer.step(lr)
        cost.stop(rank.ledger)
        if m.routing.rate:
            m.routing.update(loads)
            moe["moe_bias_max_abs"] = m.routing.max_abs()
    # Otherwise (the same on every rank, after the reductions) no update is applied; the
    # caller skips the step or stops (--on-nan).
    docs = batch.documents
    imbalance = attention_imbalance(docs, m.seq, cfg.model.windows(), m.ulysses,
                                    rank.layout.dp, rank.data.rows_per_dp,
                                    rank.data.microbatches, mbs)
    return StepResult(step + 1, loss, grad_norm, lr, time.perf_counter() - t0,
                      tr.global_batch_size * rows_per * tr.seq_len, imbalance, moe,
                      (None if docs is None else model_flops_per_step(cfg, docs))
                      if pref is None else rows_per * model_flops_per_step(cfg), rewards,
                      batch.targets, cost, mtp_loss)


def _preference_metrics(rank: Rank, batch: StepBatch) -> dict[str, float]:
    """The DPO step's mean rewards and accuracy over the global batch's pairs
    (:class:`mpipar.training.objective.PairLoss` stats of the last stage), on every rank."""
    stats = sum((mb.loss.stats for mb in batch.microbatches), np.zeros(3))
    if rank.coord.pp != rank.cfg.parallel.pp - 1:
        stats = np.zeros(3)
    g = rank.comms.groups
    buf = g["dp_sp"].allreduce_(rank.compute.xp.asarray(stats))
    got = to_host(g["pp"].bcast_(buf, root=rank.cfg.parallel.pp - 1)) / batch.divisor
    return {"dpo_reward_chosen": float(got[0]), "dpo_reward_rejected": float(got[1]),
            "dpo_accuracy": float(got[2])}


def _grads_ready(rank: Rank) -> Callable[[list[str]], None]:
    """The step's callback for a chunk that has finished the gradients of ``names``: those
    every chunk of this rank that uses them has finished are final: sum the tp-partial ones
    over tp, then let the data-parallel reducer launch their buckets (and sum the tied ones
    over ``pp_ends`` when it finishes). Under LoRA a linear's adapter is final with it, and
    only the trainable gradients go on."""
    unfinished = Counter(rank.model.holders)
    table, tensor, grads = rank.model.table, rank.model.tensor, rank.grads
    lora = table.lora

    def ready(names: list[str]) -> None:
        final = []
        for n in (names if lora is None else lora.expand(names)):
            unfinished[n] -= 1
            if not unfinished[n] and table[n].trainable:
                final.append(n)
        tensor.reduce_partial_grads([grads[n] for n in final
                                     if table[n].grad_partial_over_tp])
        rank.weights.reducer.ready(final)
    return ready


def _moe_stats(rank: Rank) -> tuple[dict[str, Any], dict[int, np.ndarray]]:
    """The step's mixture-of-experts record and loads (:func:`mpipar.observe.balance.
    moe_load_stats`): the chunks' balance losses, loads and drops summed over the world, each
    counted on tp rank 0 only (tp ranks compute the same), on every rank."""
    m = rank.cfg.model
    sparse = [i for i in all_blocks(m) if m.is_sparse(i)]
    n, E = len(sparse), m.moe_experts
    buf = rank.compute.xp.zeros(1 + n * (E + 1))
    if rank.model.tensor.rank == 0:
        for ch in rank.model.chunks:
            buf[0] += ch.moe_aux
            for i, load in ch.moe_load.items():
                j = 1 + sparse.index(i) * E
                buf[j:j + E] += load
                buf[1 + n * E + sparse.index(i)] += ch.moe_dropped.get(i, 0)
    rank.comms.groups["dp_sp"].allreduce_(buf)
    rank.comms.groups["tp_pp"].allreduce_(buf)
    return moe_load_stats(to_host(buf), sparse, E, m.moe_aux_loss_coef,
                          rank.cfg.train.global_batch_size)


def _global_sum(rank: Rank, loss: float) -> float:
    """The sum over the world of the last stage's summed token losses (over dp x sp, then
    broadcast from the last pipeline stage), on every rank."""
    g = rank.comms.groups
    buf = g["dp_sp"].allreduce_(rank.compute.xp.array([loss]))
    return float(g["pp"].bcast_(buf, root=rank.cfg.parallel.pp - 1)[0])


def _forward_losses(rank: Rank) -> Callable[[StepBatch], dict[int, Any]]:
    """``losses(batch)``: the last stage's per-token losses of a batch's microbatches by index
    (empty off the last stage), forward only under this layout."""
    m, sharded = rank.model, rank.weights.sharded
    shape = m.tensor.stream_shape(rank.layout.micro_rows, len(m.positions),
                                  rank.cfg.model.hidden)

    def stage_forward(chunk: LlamaStage, inp: Any, mb: Microbatch) -> Any:
        return chunk.forward_only(rank.params, inp,
                                  m.positions if mb.positions is None else mb.positions,
                                  mb.targets, scope=sharded or RESIDENT)

    def losses(batch: StepBatch) -> dict[int, Any]:
        return rank.evaluator.run_forward(list(batch.microbatches), shape, rank.compute.dtype,
                                          stage_forward)
    return losses


def evaluate(rank: Rank) -> EvalResult:
    """The mean token loss over the validation batches (``--eval-batches``), computed under
    this layout forward only (module docstring); the same on every rank."""
    evals = rank.data.eval_set
    if evals is None:
        raise ValueError("evaluate: no validation set (--eval-data or --eval-fraction)")
    t0 = time.perf_counter()
    sharded = rank.weights.sharded
    forward = _forward_losses(rank)
    total, tokens = 0.0, 0
    rank.eval_ledger.reset()
    with booked_to(rank.comms.groups.values(), rank.eval_ledger), \
            (sharded.forward_only() if sharded else nullcontext()):
        for k in range(evals.batches):
            batch = prepare(rank, evals, k)
            micro = batch.microbatches
            losses = forward(batch)
            total += sum(float((losses[i] if micro[i].counted is None
                                else losses[i] * micro[i].counted).sum())
                         for i in sorted(losses))
            tokens += batch.divisor
        loss = _global_sum(rank, total) / tokens
    try:
        perplexity = math.exp(loss)
    except OverflowError:
        perplexity = math.inf
    return EvalResult(loss, perplexity, tokens, time.perf_counter() - t0)


def _dropout_selector(rank: Rank, step: int):
    """What tells LoRA's dropout which microbatch of step ``step`` is computed
    (:class:`mpipar.model.lora_dropout.LoraDropout`), or None without dropout."""
    adapters = rank.model.tensor.adapters
    dropout = None if adapters is None else adapters.dropout
    if dropout is None:
        return None

    def select(mb) -> None:
        if mb is None:
            dropout.select(None)
        else:
            dropout.select(step, mb.rows,
                           rank.model.positions if mb.positions is None else mb.positions)
    return select


def reference_logps(rank: Rank) -> np.ndarray:
    """The DPO reference log-probabilities ``[2 * pairs]`` of every sequence of the training
    pairs (:mod:`mpipar.training.objective`): the policy's now, forward only, one global batch
    of pairs after another in order (packed as training packs them), summed over dp and sent
    from the last pipeline stage to every rank."""
    pref, tr, g = rank.data.preference, rank.cfg.train, rank.comms.groups
    order = Sampler(rank.data.source, tr.global_batch_size, 0, shuffle=False,
                    samples=pref.pairs)
    forward, sharded = _forward_losses(rank), rank.weights.sharded
    rows, out = 2 * tr.micro_batch_size, np.zeros(2 * pref.pairs)
    with sharded.forward_only() if sharded else nullcontext():
        for k in range(-(-pref.pairs // tr.global_batch_size)):
            batch = prepare(rank, order, k)
            got = np.zeros(2 * tr.global_batch_size)
            base = rank.coord.dp * 2 * rank.data.rows_per_dp
            for i, token_loss in forward(batch).items():
                at = base + i * rows
                got[at:at + rows] = to_host(batch.microbatches[i].loss.sequences.logps(token_loss))
            buf = g["dp_sp"].allreduce_(rank.compute.xp.asarray(got))
            got = to_host(g["pp"].bcast_(buf, root=rank.cfg.parallel.pp - 1))
            out[pref.rows(order.indices(k))] = got
    return out


def _start_dump(rank: Rank, step: int) -> ActivationRecorder | None:
    """--dump-activations: a recorder installed on every chunk for this step, or None. With tp
    sequence parallelism the stream tensors are all-gathered over tp for the dump."""
    if step + 1 not in rank.cfg.dump_steps:
        return None
    chunks, tensor = rank.model.chunks, rank.model.tensor
    recorder = ActivationRecorder.for_schedule(rank.executor.ops, list(chunks))
    shape = (rank.cfg.train.micro_batch_size, len(rank.model.positions), -1)

    def record(layer: int, name: str, value: Any) -> None:
        if tensor.sequence_parallel and name != "attention":
            value = tensor.enter(value).reshape(shape)
        recorder(layer, name, value)

    for ch in chunks:
        ch.recorder = record
    return recorder


def _activation_region(rank: Rank, step: int) -> ActivationRegion:
    """The part of step ``step``'s (1-based) global activations this rank's dump holds: its dp
    rows and their samples, its sp positions, its tp heads."""
    c, rows_per_dp, tp = rank.coord, rank.data.rows_per_dp, rank.comms.groups["tp"]
    rows = np.arange(c.dp * rows_per_dp, (c.dp + 1) * rows_per_dp)
    heads = rank.cfg.model.heads // tp.size
    return ActivationRegion(step=step, rows=rows,
                            samples=rank.data.sampler.indices(step - 1)[rows],
                            positions=np.asarray(rank.model.positions, dtype=np.int64),
                            segments=np.asarray(rank.model.seq.segments(c.sp), dtype=np.int64),
                            heads=(tp.rank * heads, (tp.rank + 1) * heads))


# ------------------------------------------------------------------ what checkpoints see
def rank_place(rank: Rank) -> RankPlace:
    """This rank's place in the process grid."""
    g = rank.comms.grid
    return RankPlace(rank=g.rank, world_size=g.comm.Get_size(), coord=g.coord,
                     sizes=(g.dp, g.tp, g.pp, g.sp))


def run_position(rank: Rank, step: int) -> RunPosition:
    """Where the run stands after ``step`` training steps: the configuration, this rank's
    place, the LR schedule's state, the data cursor and the routing biases (what a checkpoint
    records besides ``rank.state``), with a DPO run's reference log-probabilities."""
    s, tr, source = rank.weights.schedule, rank.cfg.train, rank.data.source
    pref = rank.data.preference
    lr = LRScheduleState(kind=s.kind, lr=s.lr, min_lr=s.min_lr, warmup_steps=s.warmup_steps,
                         total_steps=s.total_steps, decay_fraction=s.decay_fraction,
                         decay_shape=s.decay_shape, decay_start=s.decay_start,
                         next_step=step, next_lr=s(step))
    data = DataCursor(path=str(source.path), seed=tr.seed, shuffle=tr.shuffle,
                      global_batch_size=tr.global_batch_size, seq_len=tr.seq_len,
                      num_samples=source.num_samples, next_step=step,
                      samples_consumed=step * tr.global_batch_size,
                      eval_fraction=tr.eval_fraction,
                      train_samples=rank.data.sampler.num_samples)
    return RunPosition(step=step, config=rank.cfg, place=rank_place(rank), lr_schedule=lr,
                       data=data, moe_bias=rank.model.routing.host(),
                       dpo_reference=None if pref is None else pref.reference)


def close(rank: Rank) -> None:
    """Release what outlives steps: the offload scratch file (removed) and the grid's and the
    reducer's communicators (MPI has a few thousand per process). No MPI call on ``rank``
    after it."""
    if rank.model.offload is not None:
        rank.model.offload.close()
    rank.weights.reducer.close()
    for name in ("ep", "ep_dp"):
        if name in rank.comms.groups:
            rank.comms.groups[name].comm.Free()
    rank.comms.grid.free()


# ------------------------------------------------------------------------ global tensors
def gather_params(rank: Rank) -> dict[str, np.ndarray]:
    """Every global parameter (the master weights), assembled from all shards, on every rank
    (tests, export): each pipeline rank joins the tensors it holds from its tp ranks' shards in
    one all-gather, then broadcasts them to the other pipeline ranks in one call; an expert held
    at one ep position comes from its owner, one call per owner."""
    g, table, xp = rank.comms.groups, rank.model.table, rank.compute.xp
    tp, pp = g["tp"], g["pp"]
    frozen = rank.weights.frozen
    params = {**(frozen.master_tensors() if frozen is not None else {}),
              **rank.weights.reducer.master_tensors()}
    dtype = rank.compute.master_dtype
    held = [p for p in table if table.holds(p.name, rank.comms.ep_rank)]
    out: dict[str, np.ndarray] = {}
    for owner in range(pp.size):
        stage = [p for p in held if table.pipeline_rank(p.name) == owner]
        if not stage:
            continue
        if pp.rank == owner:
            local = [xp.ascontiguousarray(params[p.name]).astype(dtype, copy=False).ravel()
                     for p in stage]
            flat = xp.concatenate(local)
            pieces = to_host(tp.allgather(flat, xp.empty((tp.size, flat.size), dtype)))
            fulls, at = [], 0
            for p, one in zip(stage, local):
                shape = params[p.name].shape
                fulls.append(np.ascontiguousarray(p.unshard(
                    [piece[at:at + one.size].reshape(shape) for piece in pieces])).ravel())
                at += one.size
            whole = np.concatenate(fulls)
        else:
            whole = np.empty(sum(math.prod(p.spec.shape) for p in stage), dtype)
        whole = pp.bcast_(whole, root=owner)
        at = 0
        for p in stage:
            n = math.prod(p.spec.shape)
            out[p.name] = whole[at:at + n].reshape(p.spec.shape)
            at += n
    if table.ep > 1:   # an expert held at one ep position (tp and pp ranks alike hold it or not)
        experts = [p for p in table if expert_of(p.name) is not None]
        for owner in sorted({table.expert_owner(p.name) for p in experts}):
            mine = [p for p in experts if table.expert_owner(p.name) == owner]
            whole = (np.concatenate([out[p.name].ravel() for p in mine])
                     if g["ep"].rank == owner else
                     np.empty(sum(math.prod(p.spec.shape) for p in mine), dtype))
            whole = g["ep"].bcast_(whole, root=owner)
            at = 0
            for p in mine:
                n = math.prod(p.spec.shape)
                out[p.name] = whole[at:at + n].reshape(p.spec.shape)
                at += n
    return {p.name: out[p.name] for p in table}


def load_params(rank: Rank, values: dict[str, np.ndarray], source: str = "load_params",
                partial: bool = False) -> None:
    """Overwrite this rank's shards from global tensors (every name the model has, global
    shapes as in :func:`mpipar.model.params.param_specs`), cast to the master dtype (the compute
    copies follow). A tensor holding a NaN or an infinity (after the cast) raises
    :class:`~mpipar.checkpoint.shards.NonFiniteError` naming ``source`` and the tensor.
    LoRA adapters not in ``values`` keep theirs (a base model has none); ``partial``: only the
    tensors given are loaded (a LoRA adapter alone). Collective-free."""
    table, tensor, reducer = rank.model.table, rank.model.tensor, rank.weights.reducer
    frozen = rank.weights.frozen
    missing = sorted(p.name for p in table if p.name not in values and not is_adapter(p.name))
    if missing and not partial:
        raise ValueError(f"load_params: missing parameters {missing[:5]}")
    stores = [reducer] if frozen is None else [reducer, frozen]
    for store, name in [(s, n) for s in stores for n in s.local_shapes() if n in values]:
        placement, value = table[name], np.asarray(values[name])
        if value.shape != placement.spec.shape:
            raise ValueError(f"load_params: {name} has shape {value.shape}, the model needs "
                             f"{placement.spec.shape}")
        value = value.astype(rank.compute.master_dtype)
        require_finite(value, f"{source}: parameter {name}")
        store.load_local(name, placement.shard(value, tensor.rank, tensor.size))
