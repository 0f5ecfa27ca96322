"""Decoding with a KV cache under tensor and pipeline parallelism: :class:`Generator`.

A :class:`Generator` is one rank's share of a model for generation, on a grid of
``world = tp x pp`` (no data or sequence parallelism: one sequence, whole on every rank). It is
built from a resolved :class:`mpipar.config.Config` like the training engine and uses the same
seams: the placement table shards the parameters, the model chunk (:class:`LlamaStage`) holds no
MPI, :class:`TensorParallel` carries the tp collectives, and the pipeline executor walks a
forward-only op list (:func:`mpipar.parallel.pipeline.schedule.forward_only` of a one-microbatch
schedule) with point-to-point messages on the pp group.

One decoding step feeds the new tokens through every stage with
:meth:`LlamaStage.forward_only` and a :class:`KVCache` (the prompt at once, then one token at
a time); the last stage gathers its vocabulary shards over tp
(:meth:`TensorParallel.gather_vocab`) and broadcasts the last position's logits over pp, so
every rank holds the same logits and picks the same next token (:mod:`mpipar.inference.sampling`, one
generator per rank, seeded alike). Greedy output equals transformers' ``generate`` token for
token, from one rank or any tp x pp (tests/{unit,mpi}/test_generate.py). A model with latent
attention caches its compressed latent and RoPE key per position (:class:`LatentKVCache`), each
block's keys and values expanded from them while it attends.

Parameters come from global tensors (:meth:`Generator.load_params`: a Hugging Face directory)
or straight from a sharded mpipar checkpoint of any layout (:meth:`Generator.load_checkpoint`:
each rank reads the regions its shards cover; no consolidation).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpipar.runtime.mpi_init import MPI

from mpipar.runtime.device import to_host, training_backend
from mpipar.runtime.comm import Group, Ledger
from mpipar.config import Config
from mpipar.model.attention import LocalAttention
from mpipar.model.latent_attention import LatentKVCache, absorbed_attention, up_projection
from mpipar.model.llama import KVCache, LlamaStage
from mpipar.parallel.pipeline.executor import Microbatch, PipelineExecutor
from mpipar.parallel.pipeline.schedule import build_schedule, forward_only
from mpipar.parallel.tensor.ops import TensorParallel
from mpipar.parallel.placement import PlacementTable
from mpipar.inference.sampling import Sampling, next_token
from mpipar.checkpoint.shards import Reader, read_shard
from mpipar.runtime.topology import ProcessGrid


@dataclass
class Generation:
    """What :meth:`Generator.generate` produced (the same on every rank)."""

    ids: list[int]                 # the new tokens, in order
    stopped: str                   # "length" (max_new_tokens reached) or "eos"
    logits: list[np.ndarray] = field(default_factory=list)  # [V] each token was picked from


class Generator:
    """This rank's share of a model for decoding under tp x pp (module docstring)."""

    def __init__(self, cfg: Config, comm: MPI.Comm | None = None) -> None:
        """``cfg``: resolved, with dp = sp = 1: the model, ``parallel.tp`` and ``parallel.pp``,
        ``train.dtype`` and ``train.backend``. Load parameters next (:meth:`load_params` or
        :meth:`load_checkpoint`)."""
        comm = MPI.COMM_WORLD if comm is None else comm
        par = cfg.parallel
        self.model = cfg.model
        self.grid = ProcessGrid(comm, 1, par.tp, par.pp, 1)
        self.ledger = Ledger()
        groups = {name: Group(c, name, self.ledger) for name, c in self.grid.comms.items()}
        self.kernels = training_backend(cfg.train.backend)
        self.xp, self.dtype = self.kernels.xp, np.dtype(cfg.train.dtype)
        self.table = PlacementTable(model=self.model, pp=par.pp)
        self.tensor = TensorParallel(kernels=self.kernels, table=self.table, group=groups["tp"])
        rank = self.grid.coord.pp
        self.stage = LlamaStage(cfg=self.model, kernels=self.kernels,
                                layers=self.table.stage_layers(rank), first=rank == 0,
                                last=rank == par.pp - 1, tp=self.tensor,
                                attention=LocalAttention(self.kernels))
        self.pp = groups["pp"]
        ops = forward_only(build_schedule("gpipe", par.pp, 1))[rank]
        self.executor = PipelineExecutor(ops=ops, chunks=[self.stage], pp=self.pp, xp=self.xp)
        self.params: dict[str, Any] = {}

    def load_params(self, values: dict[str, np.ndarray],
                    moe_bias: dict[int, Any] | None = None) -> None:
        """This rank's shards from the global tensors ``values`` (every parameter of its stage),
        cast to the dtype, and the routers' selection biases ``moe_bias`` (as
        :meth:`load_checkpoint`'s). Collective-free."""
        self.stage.moe_bias = {i: self.xp.asarray(b, dtype="float64")
                               for i, b in (moe_bias or {}).items()}
        tp = self.tensor
        self.params = {n: self.xp.asarray(self.table[n].shard(np.asarray(values[n], self.dtype),
                                                              tp.rank, tp.size))
                       for n in self.stage.param_names()}

    def load_checkpoint(self, read: Reader, moe_bias: dict[int, Any] | None = None) -> None:
        """This rank's shards read region by region from a checkpoint of any layout
        (:func:`mpipar.checkpoint.reader.open_reader`), and its routing biases ``moe_bias``
        (``{sparse block: [E]}``, :func:`mpipar.checkpoint.reader.read_moe_bias`): the experts
        are chosen as in training. Collective-free."""
        tp = self.tensor
        self.params = {n: self.xp.asarray(read_shard(read, "param", self.table[n], tp.rank,
                                                     tp.size, self.dtype))
                       for n in self.stage.param_names()}
        self.stage.moe_bias = {i: self.xp.asarray(b, dtype="float64")
                               for i, b in (moe_bias or {}).items()}

    def generate(self, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling,
                 seed: int = 0, eos: int | None = None, keep_logits: bool = False,
                 cache: KVCache | LatentKVCache | None = None) -> Generation:
        """Up to ``max_new_tokens`` tokens after ``prompt`` (ids in ``[0, vocab_size)``), each
        picked by ``sampling`` with a generator seeded by ``seed``; stops early after ``eos``.
        ``cache``: an empty one of at least ``len(prompt) + max_new_tokens`` positions (default
        :meth:`new_cache`'s). Collective over the grid; the same result on every rank and every
        layout."""
        if not prompt or min(prompt) < 0 or max(prompt) >= self.model.vocab_size:
            raise ValueError(f"prompt ids must be a non-empty list in [0, "
                             f"{self.model.vocab_size}), got {list(prompt)[:8]}...")
        rng = np.random.default_rng(seed)
        kv = self.new_cache(len(prompt) + max_new_tokens) if cache is None else cache
        out = Generation([], "length")
        feed = np.asarray([prompt], dtype=np.int64)
        for _ in range(max_new_tokens):
            logits = self.next_logits(feed, kv)[0]
            token = next_token(logits, sampling, rng)
            out.ids.append(token)
            if keep_logits:
                out.logits.append(logits)
            if token == eos:
                out.stopped = "eos"
                break
            feed = np.asarray([[token]], dtype=np.int64)
        return out

    def new_cache(self, capacity: int, latent: bool | None = None,
                  absorb: bool = True) -> KVCache | LatentKVCache:
        """An empty cache of ``capacity`` positions for this rank's blocks: of latent
        attention's compressed latents and RoPE keys (:class:`LatentKVCache`; ``latent`` None:
        where the model has latent attention), attended with ``kv_b_proj`` absorbed into the
        queries and the output (``absorb``, :func:`absorbed_attention`) or by expanding the
        cached latents; else of this rank's kv heads' keys and values (:class:`KVCache`, also a
        latent model's expanded form with ``latent=False``). A latent cache uses the parameters
        loaded when it is made."""
        m, layers = self.model, self.stage.layers
        if m.latent if latent is None else latent:
            return LatentKVCache.empty(
                self.xp, layers, 1, capacity, m, self.dtype,
                up_projection(self.kernels, self.tensor, self.params, m),
                absorbed_attention(self.kernels, self.params, m) if absorb else None)
        return KVCache.empty(self.xp, layers, 1, capacity, m.kv_heads // self.tensor.size,
                             m.head_dim, self.dtype)

    def next_logits(self, ids: np.ndarray, kv: KVCache | LatentKVCache) -> np.ndarray:
        """Feed ``ids`` ``[B, n]`` (the positions after the ``kv.length`` cached ones) through
        the model, appending to ``kv``; return the logits ``[B, V]`` of their last position, on
        every rank."""
        B, n = ids.shape
        positions = np.arange(kv.length, kv.length + n)

        def stage_forward(chunk: LlamaStage, inp: Any, mb: Microbatch) -> Any:
            return chunk.forward_only(self.params, inp, positions, kv=kv)

        shape = self.tensor.stream_shape(B, n, self.model.hidden)
        out = self.executor.run_forward([Microbatch(self.xp.asarray(ids), None)], shape,
                                        self.dtype, stage_forward)
        kv.length += n
        logits = np.empty((B, self.model.vocab_size), self.dtype)
        if self.stage.last:
            last = self.xp.ascontiguousarray(out[0].reshape(B, n, -1)[:, -1])
            logits[...] = to_host(self.tensor.gather_vocab(last))
        return self.pp.bcast_(logits, root=self.grid.pp - 1)

    def close(self) -> None:
        """Free the grid's communicators."""
        self.grid.free()
