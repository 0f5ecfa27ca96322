"""LoRA: low-rank adapters on a block's linears, the base weights frozen.

A targeted linear ``y = x W^T`` becomes ``y = x W^T + s (x A^T) B^T`` with ``A`` ``[r, in]``,
``B`` ``[out, r]`` and the scale ``s = alpha / r`` (rsLoRA: ``alpha / sqrt(r)``, PEFT's
``use_rslora``). Only the adapters train; the base has no gradient, no optimizer state and no
reduction (:class:`FrozenGrads` is the gradients a stage writes: a frozen weight's go nowhere).

The adapters are parameters like the others, named after their linear's weight as PEFT names
them without its ``base_model.model.model.`` prefix: ``layers.{i}.self_attn.q_proj.lora_A.weight``
and ``...lora_B.weight`` (:func:`adapter_names`). Targets are Hugging Face module names
(:data:`TARGETS`, PEFT's ``target_modules``). ``A`` starts as PEFT's default (Kaiming-uniform:
``U(-1/sqrt(in), 1/sqrt(in))``), ``B`` as zeros, so the adapted model starts as the base.

How tensor parallelism splits the two factors is the placement table's
(:func:`mpipar.parallel.placement.adapter_roles`); :class:`Adapters` is what a linear adds and
books whatever the split: its input as the linear reads it, its output as the linear leaves
it before any sum over tp, so the adapted linear keeps its one collective.

A mixture of experts' routed experts are adapted as PEFT adapts transformers' fused 3-D expert
tensors (``LoraConfig(target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"])``): the targets :data:`EXPERT_TARGETS` ``experts.gate_up_proj`` and
``experts.down_proj``. ``gate_up_proj`` is each expert's gate and up projections stacked
``[2F, H]`` (gate rows first): one ``A`` ``[r, H]`` shared by both and one ``B`` ``[2F, r]``
whose first ``F`` rows add to the gate and the others to the up projection (``x A^T`` computed
once); ``down_proj`` ``[H, F]`` has ``A`` ``[r, F]``, ``B`` ``[H, r]``. mpipar holds them per
expert, beside the expert's weights (so expert parallelism places them with their expert):
``layers.{i}.block_sparse_moe.experts.{e}.gate_up_proj.lora_A.weight`` and so on
(:meth:`Lora.factor_names`); :mod:`mpipar.checkpoint.peft` reads and writes PEFT's fused
``[r*E, in]`` / ``[out, r*E]`` tensors. :class:`ExpertAdapters` is what an expert's SwiGLU adds
(:mod:`mpipar.model.moe`). PEFT has no dropout on such adapters, nor does mpipar. On a mixture
of experts ``gate_proj``, ``up_proj`` and ``down_proj`` are refused: PEFT (0.21, with
transformers 5) rewrites those ``target_modules`` of a Mixtral, Qwen2-MoE or Qwen3-MoE model
into the experts' ``target_parameters`` at twice the rank (a ``rank_pattern``), so they name
neither the dense blocks' nor the shared expert's linears there.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpipar.config import TrainConfig, require
from mpipar.model.lora_dropout import LoraDropout
from mpipar.model.params import ParamSpec, block_param_specs, expert_names

Array = Any

TARGETS: dict[str, str] = {
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "q_a_proj": "self_attn.q_a_proj.weight",
    "q_b_proj": "self_attn.q_b_proj.weight",
    "kv_a_proj_with_mqa": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_b_proj": "self_attn.kv_b_proj.weight",
}
"""The linears an adapter may target: Hugging Face module name -> weight name without the
block's ``layers.{i}.``. A run's targets must be linears its model has (:func:`check_config`):
standard attention's q/k/v/o, latent attention's (:mod:`mpipar.model.latent_attention`)
``q_a_proj`` and ``q_b_proj`` (or ``q_proj`` without a query latent), ``kv_a_proj_with_mqa``,
``kv_b_proj`` and ``o_proj``, and a dense model's FFN."""

FFN_TARGETS = ("gate_proj", "up_proj", "down_proj")

EXPERT_TARGETS: dict[str, str] = {
    "experts.gate_up_proj": "w1",
    "experts.down_proj": "w2",
}
"""The routed experts' adapters (module docstring): target -> the expert weight (Mixtral's name,
:data:`mpipar.model.params.EXPERT`) its factors are placed after. A target's PEFT
``target_parameters`` entry is ``mlp.`` + the target."""

FACTORS = ("lora_A", "lora_B")


def adapter_names(weight: str) -> tuple[str, str]:
    """(A, B) of the linear of weight ``weight`` (``...q_proj.weight`` ->
    ``...q_proj.lora_A.weight``, ``...q_proj.lora_B.weight``)."""
    stem = weight.removesuffix("weight")
    return stem + "lora_A.weight", stem + "lora_B.weight"


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is an adapter factor."""
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


def factor_of(name: str) -> str:
    """``lora_A`` or ``lora_B`` of adapter ``name``."""
    return name.split(".")[-2]


def base_of(name: str) -> str:
    """The weight the adapter factor ``name`` adapts."""
    return name.rsplit(".", 2)[0] + ".weight"


@dataclass(frozen=True)
class Lora:
    """A run's adapters: their rank, alpha, targets (Hugging Face module names, in
    :data:`TARGETS` order), whether the scale is rank-stabilised and the dropout probability
    on their input (:mod:`mpipar.model.lora_dropout`)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False
    dropout: float = 0.0

    @classmethod
    def of(cls, train: TrainConfig) -> Lora | None:
        """The adapters ``train`` asks for, or None (``lora_rank`` 0). ConfigError names an
        unknown or repeated target."""
        if train.lora_rank <= 0:
            return None
        given = [t.strip() for t in train.lora_targets.split(",") if t.strip()]
        known = [*TARGETS, *EXPERT_TARGETS]
        for t in given:
            require(t in known, f"train.lora_targets={train.lora_targets!r}: {t!r} is not a "
                                f"target; the targets are {', '.join(known)}")
        require(given and len(set(given)) == len(given),
                f"train.lora_targets={train.lora_targets!r}: must name each target once, at "
                f"least one")
        return cls(train.lora_rank, float(train.lora_alpha),
                   tuple(t for t in known if t in given), bool(train.lora_rslora),
                   float(train.lora_dropout))

    @property
    def module_targets(self) -> tuple[str, ...]:
        """The targeted linears (PEFT's ``target_modules``)."""
        return tuple(t for t in self.targets if t in TARGETS)

    @property
    def expert_targets(self) -> tuple[str, ...]:
        """The targeted expert tensors (PEFT's ``target_parameters``, less ``mlp.``)."""
        return tuple(t for t in self.targets if t in EXPERT_TARGETS)

    @property
    def scale(self) -> float:
        """``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @property
    def weights(self) -> frozenset[str]:
        """The targeted weights without ``layers.{i}.``."""
        return frozenset(TARGETS[t] for t in self.module_targets)

    def adapts(self, name: str) -> bool:
        """Whether weight ``name`` carries an adapter."""
        parts = name.split(".", 2)
        return parts[0] == "layers" and len(parts) == 3 and parts[2] in self.weights

    def expert_target(self, name: str) -> str | None:
        """The expert target (:data:`EXPERT_TARGETS`) whose factors follow expert weight
        ``name`` (``layers.{i}.block_sparse_moe.experts.{e}.w1.weight``: gate_up_proj's), if
        targeted."""
        parts = name.split(".")
        if len(parts) != 7 or parts[2:4] != ["block_sparse_moe", "experts"]:
            return None
        return next((t for t in self.expert_targets if EXPERT_TARGETS[t] == parts[5]), None)

    def factor_names(self, name: str) -> tuple[str, ...]:
        """(A, B) placed after weight ``name``: its own adapter's, or after an expert's gate
        ``w1`` its ``gate_up_proj``'s and after its ``w2`` its ``down_proj``'s; () if none."""
        if self.adapts(name):
            return adapter_names(name)
        target = self.expert_target(name)
        if target is None:
            return ()
        stem = name.rsplit(".", 2)[0] + "." + target.split(".")[1]
        return stem + ".lora_A.weight", stem + ".lora_B.weight"

    def specs(self, base: ParamSpec) -> list[ParamSpec]:
        """The adapter factors placed after weight ``base`` (:meth:`factor_names`): ``A``
        ``[r, in]`` and ``B`` ``[out, r]`` of its linear, of an expert's gate_up_proj
        ``[r, H]`` and ``[2F, r]``."""
        names = self.factor_names(base.name)
        if not names:
            return []
        out, inp = base.shape
        if self.expert_target(base.name) == "experts.gate_up_proj":
            out *= 2
        return [ParamSpec(names[0], (self.rank, inp), base.layer),
                ParamSpec(names[1], (out, self.rank), base.layer)]

    def expand(self, names: list[str]) -> list[str]:
        """``names`` with each targeted weight followed by its A and B."""
        return [x for n in names for x in (n, *self.factor_names(n))]


def init_adapter(spec: ParamSpec, seed: int) -> np.ndarray:
    """The global float64 initial value of an adapter factor (layout-independent, seeded by
    ``(seed, crc32(name))``): A Kaiming-uniform as PEFT's, B zeros."""
    if factor_of(spec.name) == "lora_B":
        return np.zeros(spec.shape)
    bound = 1.0 / math.sqrt(spec.shape[1])
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    return rng.uniform(-bound, bound, size=spec.shape)


def check_config(layout) -> None:
    """LoRA's rules: known targets that the model has, a rank in ``[1, min(in, out)]`` of every
    targeted linear (of an expert: ``min(H, F)``), a dropout in ``[0, 1)`` and none on the
    experts' adapters; on a mixture-of-experts model no ``gate_proj``, ``up_proj``,
    ``down_proj`` (module docstring)."""
    cfg = layout.config
    t, m = cfg.train, cfg.model
    lora = Lora.of(t)
    if lora is None:
        require(not t.lora_rslora, f"train.lora_rslora={t.lora_rslora}: needs --lora-rank > 0")
        require(t.lora_dropout == 0,
                f"train.lora_dropout={t.lora_dropout}: needs --lora-rank > 0")
        return
    require(0 <= t.lora_dropout < 1, f"train.lora_dropout={t.lora_dropout}: must be in [0, 1)")
    ffn = [x for x in lora.targets if x in FFN_TARGETS]
    if m.moe_experts and ffn:
        require(False, f"train.lora_targets={t.lora_targets!r}: {', '.join(ffn)} on a "
                       f"mixture-of-experts model (model.moe_experts={m.moe_experts}): PEFT "
                       f"turns these target_modules of a mixture of experts into the experts' "
                       f"fused target_parameters at twice the rank; target the routed experts "
                       f"as {', '.join(EXPERT_TARGETS)}")
    require(not (lora.expert_targets and t.lora_dropout),
            f"train.lora_dropout={t.lora_dropout}: the experts' adapters "
            f"({', '.join(lora.expert_targets)}) have no dropout (PEFT's target_parameters "
            f"refuse lora_dropout); give --lora-dropout 0")
    specs = [s for i in range(m.layers) for s in block_param_specs(m, i)]
    short = {s.name.split(".", 2)[2] for s in specs}
    has = [x for x, w in TARGETS.items() if w in short]
    if any(".block_sparse_moe.experts." in s.name for s in specs):
        has += list(EXPERT_TARGETS)
    for x in lora.targets:
        require(x in has, f"train.lora_targets={t.lora_targets!r}: the model has no {x!r}; "
                          f"its targets are {', '.join(has)}")
    for spec in specs:
        if lora.factor_names(spec.name):
            width = min(spec.shape)
            require(lora.rank <= width,
                    f"train.lora_rank={lora.rank}: must be <= {width}, the smaller side of "
                    f"{spec.name.split('.', 2)[2]} {list(spec.shape)}")


class Adapters:
    """What a linear with an adapter adds forward and books backward (module docstring),
    with ``kernels``' ops. ``x_in`` is the input as the linear reads it, ``dy`` its output's
    gradient as the linear produced it (this rank's output columns, or the whole output of a
    row-parallel linear before the sum over tp); ``columns`` the input columns ``x_in`` holds,
    (first, width of the whole input): what the dropout mask is keyed by. ``seed`` and
    ``seq_len`` key the dropout mask (:class:`mpipar.model.lora_dropout.LoraDropout`, None
    without dropout)."""

    def __init__(self, kernels, lora: Lora, seed: int = 0, seq_len: int = 0) -> None:
        self.kernels, self.lora, self.scale = kernels, lora, lora.scale
        self.dropout = (LoraDropout(kernels.xp, lora.dropout, seed, seq_len, lora.targets)
                        if lora.dropout > 0 else None)
        self.experts = ExpertAdapters(lora) if lora.expert_targets else None

    def adapts(self, name: str) -> bool:
        return self.lora.adapts(name)

    def _dropped(self, name: str, x_in: Array, columns: tuple[int, int] | None
                 ) -> tuple[Array, Array | None]:
        """(the adapter's input: ``x_in`` with dropout applied, the dropout factor or None)."""
        if self.dropout is None:
            return x_in, None
        first, width = columns or (0, x_in.shape[-1])
        factor = self.dropout.factor(name, x_in, first, width)
        return (x_in, None) if factor is None else (x_in * factor, factor)

    def forward(self, params: Mapping[str, Array], name: str, x_in: Array, y: Array,
                columns: tuple[int, int] | None = None) -> Array:
        """``y + s (dropout(x_in) A^T) B^T`` of linear ``name`` (``y`` as it is if no
        adapter)."""
        if not self.adapts(name):
            return y
        a, b = adapter_names(name)
        x_in, _ = self._dropped(name, x_in, columns)
        t = self.kernels.linear_fwd(x_in, params[a])
        return y + self.scale * self.kernels.linear_fwd(t, params[b])

    def backward(self, params: Mapping[str, Array], grads: Mapping[str, Array], name: str,
                 dy: Array, x_in: Array, columns: tuple[int, int] | None = None
                 ) -> Array | None:
        """The adapter's share of ``dx`` of linear ``name`` (None if it has none); the factors'
        gradients added into ``grads``."""
        if not self.adapts(name):
            return None
        a, b = adapter_names(name)
        x_in, factor = self._dropped(name, x_in, columns)
        t = self.kernels.linear_fwd(x_in, params[a])
        dt, _ = self.kernels.linear_bwd(self.scale * dy, t, params[b], dw=grads[b])
        dx, _ = self.kernels.linear_bwd(dt, x_in, params[a], dw=grads[a])
        return dx if factor is None else dx * factor


class ExpertAdapters:
    """What the adapters of a routed expert add to its SwiGLU (module docstring; ``x`` its rows
    ``[n, H]``, ``m`` ``[n, F]`` the SwiGLU's output, ``s`` the scale): ``[g | u] += s (x A^T)
    B^T`` with gate_up_proj's factors, ``y += s (m A^T) B^T`` with down_proj's. The model's
    expert code (:mod:`mpipar.model.moe`) calls these with its kernels and, backward, its
    :class:`mpipar.model.llama.LinearGrads` ``lin``, which books the factors' gradients as it
    books any weight's (now, or deferred)."""

    def __init__(self, lora: Lora) -> None:
        self.lora, self.scale = lora, lora.scale

    def names(self, i: int, e: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """((A, B) of gate_up_proj, (A, B) of down_proj) of expert ``e`` of block ``i``, each
        () when not targeted."""
        w1, _, w2 = expert_names(i, e)
        return self.lora.factor_names(w1), self.lora.factor_names(w2)

    def gate_up(self, kernels, params: Mapping[str, Array], names: tuple[str, ...], x: Array,
                g: Array, u: Array) -> tuple[Array, Array]:
        """(g, u) with the gate_up_proj adapter of factors ``names`` added for rows ``x``."""
        if not names:
            return g, u
        gu = kernels.linear_fwd(kernels.linear_fwd(x, params[names[0]]), params[names[1]])
        f = g.shape[-1]
        return g + self.scale * gu[:, :f], u + self.scale * gu[:, f:]

    def down(self, kernels, params: Mapping[str, Array], names: tuple[str, ...], m: Array,
             y: Array) -> Array:
        """``y`` with the down_proj adapter of factors ``names`` added for ``m``."""
        if not names:
            return y
        return y + self.scale * kernels.linear_fwd(kernels.linear_fwd(m, params[names[0]]),
                                                   params[names[1]])

    def down_input(self, lin, names: tuple[str, ...], dy: Array, dm: Array) -> Array:
        """``dm`` (the gradient of ``m`` through the base) plus the down adapter's share for
        the output gradient ``dy``."""
        if not names:
            return dm
        return dm + lin.input(self.scale * lin.input(dy, names[1]), names[0])

    def gate_up_input(self, lin, names: tuple[str, ...], dg: Array, du: Array, dx: Array
                      ) -> Array:
        """``dx`` plus the gate_up adapter's share for the gate's and up's gradients."""
        if not names:
            return dx
        dgu = lin.kernels.xp.concatenate([dg, du], axis=-1)
        return dx + lin.input(self.scale * lin.input(dgu, names[1]), names[0])

    def weights(self, lin, names: tuple[tuple[str, ...], tuple[str, ...]], x: Array, m: Array,
                dy: Array, dg: Array, du: Array) -> None:
        """Book the factors' gradients of one expert on its whole rows: input ``x``, SwiGLU
        output ``m``, output gradient ``dy``, gate and up gradients ``dg``, ``du``."""
        (gu_a, gu_b), (d_a, d_b) = (n or (None, None) for n in names)
        linear, s = lin.kernels.linear_fwd, self.scale
        if d_a is not None:
            lin.weight(s * dy, linear(m, lin.params[d_a]), d_b)
            lin.weight(s * lin.input(dy, d_b), m, d_a)
        if gu_a is not None:
            dgu = lin.kernels.xp.concatenate([dg, du], axis=-1)
            lin.weight(s * dgu, linear(x, lin.params[gu_a]), gu_b)
            lin.weight(s * lin.input(dgu, gu_b), x, gu_a)


class _Discard:
    """A frozen weight's gradient: whatever is added to it goes nowhere."""

    def __iadd__(self, other: Any) -> _Discard:
        return self


DISCARD = _Discard()


class FrozenGrads(MutableMapping):
    """The gradients a stage writes when some parameters are frozen: ``grads`` for the trainable
    ones; a frozen one is not ``in`` it and ``grads[frozen] += g`` does nothing."""

    def __init__(self, grads: MutableMapping[str, Array], frozen: frozenset[str]) -> None:
        self.grads, self.frozen = grads, frozen

    def __getitem__(self, name: str) -> Any:
        return DISCARD if name in self.frozen else self.grads[name]

    def __setitem__(self, name: str, value: Any) -> None:
        if value is not DISCARD:
            self.grads[name] = value

    def __delitem__(self, name: str) -> None:
        del self.grads[name]

    def __contains__(self, name: object) -> bool:
        return name not in self.frozen and name in self.grads

    def __iter__(self) -> Iterator[str]:
        return iter(self.grads)

    def __len__(self) -> int:
        return len(self.grads)



class FrozenParams:
    """LoRA's frozen base as a rank holds it whole (ZeRO-0/1/2): this rank's tp shards in the
    compute dtype, the storage interface the run reads the base through (as the frozen
    :class:`mpipar.parallel.fsdp.sharded.ShardedParams` of ZeRO-3 offers it)."""

    def __init__(self, params: dict[str, Array], xp: Any) -> None:
        self.params, self.xp = params, xp

    def local_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(v.shape) for n, v in self.params.items()}

    def master_tensors(self) -> dict[str, Array]:
        return dict(self.params)

    def load_local(self, name: str, value: Array) -> None:
        self.params[name][...] = self.xp.asarray(value)
