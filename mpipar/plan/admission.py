"""Whether a rank fits where it runs: the memory model's bytes (:mod:`mpipar.plan.memory`)
against what its node gives, asked before anything is allocated and with no collective.

Training asks three (:func:`check_memory`: the node's memory; :func:`check_device_memory`: its
GPU's; :func:`check_shared_memory`: /dev/shm under ZeRO-3 in node shared memory); generation
two (:func:`check_generation_bound` at once, from the sizes alone; then
:func:`check_generation_memory` for its rank). Each raises :class:`mpipar.config.ConfigError`
naming the need, what the node has and what to change; ``--allow-oversubscribed-memory``
skips the memory checks.
"""
from __future__ import annotations

from mpipar.config import Config, ConfigError
from mpipar.layout import Layout
from mpipar.plan.memory import (generation_lower_bound, memory_lower_bound,
                                predict_generation_memory, predict_memory, predict_peak_memory)
from mpipar.plan.rank import node_copy
from mpipar.runtime import host_memory
from mpipar.runtime.topology import rank_coord


def check_memory(cfg: Config, rank: int, on_node: int) -> None:
    """Refuse (ConfigError) a run whose rank ``rank`` is predicted to need more than its share
    of the node's available memory (``on_node`` ranks share it), before anything is allocated:
    the planner's peak (parameters, gradients, AdamW moments, activations, the token batch and
    the global tensors of initialisation; :func:`mpipar.plan.memory.predict_peak_memory`), or for
    sizes too large to list, its lower bound. ``--allow-oversubscribed-memory`` skips it."""
    available = host_memory.available_memory_bytes()
    if cfg.train.allow_oversubscribed_memory or available is None:
        return
    share = available // on_node
    need, what = memory_lower_bound(cfg), "at least"
    if need <= share:
        par = cfg.parallel
        need = predict_peak_memory(cfg, rank_coord(rank, par.dp, par.tp, par.pp, par.sp))
        what = "about"
    if need > share:
        raise ConfigError(
            f"rank {rank} needs {what} {need:,} bytes ({need / 2**30:,.3g} GiB, the planner's "
            f"estimate of its parameters, gradients, AdamW moments, activations, token batch "
            f"and initialisation) but this node has {available:,} bytes available for {on_node} "
            f"rank(s), {share:,} each: use a smaller model or batch, spread it over more ranks "
            f"or nodes (--tp, --pp, --zero 1, --recompute), or set "
            f"train.allow_oversubscribed_memory (--allow-oversubscribed-memory) to start anyway")


def check_device_memory(cfg: Config, rank: int, on_node: int,
                        free: tuple[int, int] | None = None) -> None:
    """On a CUDA device: refuse (ConfigError) a run whose rank ``rank`` is predicted to need
    more than its share of its GPU's free memory, before anything is allocated there. The
    planner's bytes of a rank (parameters, gradients, AdamW moments, activations, ZeRO's unit
    pool; :func:`mpipar.plan.memory.predict_memory`) against the free memory of the GPU divided
    among the ranks of the node that share it (``on_node`` ranks over the visible GPUs, as
    :func:`mpipar.runtime.device.gpu_for` deals them out). ``free``: (free bytes of the GPU,
    visible GPUs), asked from the device when None. ``--allow-oversubscribed-memory`` skips it."""
    from mpipar.runtime.device import device_memory, device_of
    if cfg.train.allow_oversubscribed_memory or not device_of(cfg.train).on_this_machine().gpu:
        return
    available, gpus = free if free is not None else device_memory()
    sharing = -(-on_node // max(gpus, 1))          # ranks dealt to one GPU, at most
    share = available // sharing
    par = cfg.parallel
    need = predict_memory(cfg, rank_coord(rank, par.dp, par.tp, par.pp, par.sp)).total
    if need > share:
        raise ConfigError(
            f"rank {rank} needs about {need:,} bytes of GPU memory ({need / 2**30:,.3g} GiB, the "
            f"planner's estimate of its parameters, gradients, AdamW moments and activations) "
            f"but its GPU has {available:,} bytes free for {sharing} rank(s), {share:,} each: "
            f"use a smaller model or batch, fewer ranks per GPU, or spread it (--tp, --pp, "
            f"--zero 1, --recompute), or set train.allow_oversubscribed_memory "
            f"(--allow-oversubscribed-memory) to start anyway")


def check_shared_memory(cfg: Config, rank: int, on_node: int) -> None:
    """Refuse (ConfigError) ZeRO-3 in node shared memory whose parameters (this rank's part of
    its node's copy, ``on_node`` ranks alike) would not fit the free space of the shared-memory
    directory: a window larger than it fails only when touched, with SIGBUS."""
    par = cfg.parallel
    copy = node_copy(cfg, rank_coord(rank, par.dp, par.tp, par.pp, par.sp))
    if copy is None:
        return
    # ranks sharing one copy: given nodes say; detected ones are not known yet (a collective)
    per_copy = copy[0] if par.ranks_per_node else max(1, min(par.dp * par.sp, on_node // par.tp))
    free = host_memory.shared_memory_bytes()
    need = memory_lower_bound(cfg) // 2 // per_copy * on_node   # the weights' parts
    if free is not None and need > free:
        raise ConfigError(
            f"parallel.zero_shared='node': the {on_node} rank(s) of this node hold at least "
            f"{need:,} bytes of parameters in shared memory, but {host_memory.SHARED_MEMORY_DIR} "
            f"has {free:,} bytes free: enlarge it (a container's is 64 MiB unless given more, "
            f"e.g. docker run --shm-size), or set parallel.zero_shared='off' (--zero-shared off)")


def check_generation_bound(cfg: Layout, positions: int, on_node: int, max_new_tokens: int,
                           allow_oversubscribed: bool) -> None:
    """A generation's busiest rank's least memory (:func:`mpipar.plan.memory.
    generation_lower_bound`: weights and the KV cache of ``positions`` positions) against its
    share of the node's available memory (``on_node`` ranks at least share it), so that a
    config claiming an absurd model is refused at once."""
    available = host_memory.available_memory_bytes()
    need = generation_lower_bound(cfg, positions)
    if not allow_oversubscribed and available is not None and need > available // on_node:
        raise ConfigError(_generation_message(max_new_tokens, "the busiest rank", "at least",
                                              need, available, on_node, positions))


def check_generation_memory(cfg: Layout, rank: int, on_node: int, positions: int, prompt: int,
                            read_whole: int, max_new_tokens: int,
                            allow_oversubscribed: bool) -> None:
    """Refuse (ConfigError) a generation whose rank ``rank`` is predicted
    (:func:`mpipar.plan.memory.predict_generation_memory`) to need more than its share of the
    node's available memory (``on_node`` ranks share it)."""
    available = host_memory.available_memory_bytes()
    if allow_oversubscribed or available is None:
        return
    need = predict_generation_memory(cfg, rank, positions, prompt, read_whole)
    if need > available // on_node:
        raise ConfigError(_generation_message(max_new_tokens, f"rank {rank}", "about", need,
                                              available, on_node, positions))


def _generation_message(max_new_tokens: int, who: str, what: str, need: int, available: int,
                        on_node: int, positions: int) -> str:
    return (f"{who} needs {what} {need:,} bytes ({need / 2**30:,.3g} GiB, the planner's estimate "
            f"of its weights, the KV cache of {positions:,} positions (the prompt and "
            f"--max-new-tokens {max_new_tokens:,}) and the prompt's pass) but this node has "
            f"{available:,} bytes available for {on_node} rank(s), {available // on_node:,} "
            f"each: lower --max-new-tokens, spread the model over more ranks (--tp, --pp), or "
            f"set --allow-oversubscribed-memory to start anyway")
