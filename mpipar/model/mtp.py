"""Multi-token prediction (DeepSeek-V3 report, section 2.2): ``model.mtp_depth`` D modules after
the last block, each predicting one more token ahead, by hand (no autograd).

Module ``k`` (1..D) at position ``i`` combines the previous depth's stream ``h^{k-1}_i`` (the
last block's output for k = 1, before the final norm) with the embedding of token ``t_{i+k}``:

    h'_i = M_k [RMSNorm_e(Emb(t_{i+k})) ; RMSNorm_h(h^{k-1}_i)]     (eh_proj ``[H, 2H]``)
    h^k  = TRM_k(h')                                                (one decoder block)
    p    = softmax(Head(RMSNorm_k(h^k)))                            (predicts ``t_{i+k+1}``)

The embedding and the LM head are the model's own (shared); each module has its own three
norms and projection and one block of the model's kind (of the last block's: sparse in a
DeepSeek-V3, its balance loss and loads counted with the others'). The concatenation puts the embedding
first, as the released DeepSeek-V3 checkpoints' ``eh_proj`` reads it (the report writes the
terms the other way round; the order only permutes ``M_k``'s columns). The loss is
``L_MTP = lambda / D * sum_k mean CE_k``, each mean over the positions that have a target
``k + 1`` tokens ahead inside their row (``S - k`` of a row of ``S``); training minimises the
next-token loss plus ``L_MTP`` (``model.mtp_loss_coef`` is lambda).

Parameters (DeepSeek-V3's names and layer indices): module ``k`` is block
``j = layers + k - 1``: ``layers.{j}.enorm.weight``, ``hnorm.weight`` ``[H]``,
``eh_proj.weight`` ``[H, 2H]``, the block's own parameters under ``layers.{j}.``, and
``layers.{j}.shared_head.norm.weight`` ``[H]``. The modules sit on the last pipeline stage,
which then also holds a copy of the embedding (as a tied embedding's: its gradients summed over
``pp_ends``, :mod:`mpipar.parallel.placement`). The projection is replicated over tp (every tp
rank computes it whole on the stream it holds).

The module's tokens come with the microbatch: ``ahead`` ``[D, B, S_loc]``, the tokens
``t_{i+1+k}`` (k = 1..D) at this rank's global positions ``i``, -1 past the row's end
(:mod:`mpipar.training.batches`): sequence parallelism needs no message for them.

The planner counts the modules' parameters (the placement table), FLOPs
(:func:`mpipar.model.flops.mtp_module_flops_per_token`, MFU; on a tp rank
:func:`mpipar.parallel.tensor.cost.mtp_flops`, the time model's), activations
(:mod:`mpipar.plan.memory`) and the calls their blocks, embeddings and heads make on the last
stage in a training step (:mod:`mpipar.plan.traffic`: tensor, sequence, expert and ZeRO-2/3
traffic, the embedding's copy over ``pp_ends``, their loss's reduction; validation runs no
module).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpipar.config.schema import require
from mpipar.model.embedding_scale import scale_embedding
from mpipar.model.norms import norm_weight
from mpipar.model.tensor_ops import apply_linears, apply_linears_backward

Array = Any

ENORM, HNORM, EH_PROJ, HEAD_NORM = ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                    "shared_head.norm.weight")
"""A module's own parameters, without ``layers.{j}.``."""


def _norm(params, name: str, cfg) -> Array:
    """A module norm's weight as the model's norms apply it."""
    return norm_weight(params, name, cfg.norm_unit_offset)


def mtp_layers(cfg) -> range:
    """The block indices of the modules: ``layers .. layers + mtp_depth - 1``."""
    return range(cfg.layers, cfg.layers + cfg.mtp_depth)


def all_blocks(cfg) -> range:
    """Every block index: the decoder's and the modules'."""
    return range(cfg.layers + cfg.mtp_depth)


def mtp_param_shapes(cfg) -> list[tuple[str, tuple[int, ...]]]:
    """(name without ``layers.{j}.``, shape) of a module's own parameters, in forward order
    (its block's come between ``eh_proj`` and ``shared_head.norm``)."""
    h = cfg.hidden
    return [(ENORM, (h,)), (HNORM, (h,)), (EH_PROJ, (h, 2 * h))]


def embedding_at_last(cfg) -> bool:
    """Whether the last pipeline stage reads the embedding too (a tied LM head, or the MTP
    modules' inputs): with pp > 1 it holds a copy whose gradient is summed over ``pp_ends``."""
    return cfg.tie_embeddings or cfg.mtp_depth > 0


def mtp_weights(cfg, global_rows: int, seq_len: int) -> list[float]:
    """The weight of one counted token's loss of each module: ``lambda / D`` over the targets
    ``k + 1`` ahead in the global batch, ``rows x (S - k)``."""
    d = cfg.mtp_depth
    return [cfg.mtp_loss_coef / d / (global_rows * (seq_len - k)) for k in range(1, d + 1)]


def check_config(layout) -> None:
    """MTP's rules beyond its fields': one target at least per module, a next-token objective
    without loss masks."""
    m, tr = layout.model, layout.train
    if m.mtp_depth == 0:
        return
    require(m.mtp_depth < tr.seq_len - 1,
            f"model.mtp_depth={m.mtp_depth}: must be < train.seq_len - 1 = {tr.seq_len - 1} "
            f"(module k predicts the token k + 1 ahead inside a row)")
    require(tr.objective == "tokens",
            f"model.mtp_depth={m.mtp_depth}: only with train.objective 'tokens' (not "
            f"{tr.objective!r})")
    require(not (tr.loss_mask or tr.eod_mask_loss or tr.document_masking),
            f"model.mtp_depth={m.mtp_depth}: not with --loss-mask, --eod-mask-loss or "
            f"--document-masking (the modules' targets are every token k + 1 ahead in a row)")


@dataclass
class ModuleSaved:
    """What module ``k`` keeps for backward: its input tokens, the embedding ``e`` and the
    previous stream ``h`` with their rstds, the concatenation ``cat``, the block's record
    (as the stage keeps it), the output stream ``x``, its norm ``xn`` and rstd, the logits
    ``[N, V/tp]``, targets, lse and per-token loss weights ``[N]``."""

    ids: Array
    e: Array
    rstd_e: Array
    h: Array
    rstd_h: Array
    cat: Array
    block: Any
    x: Array
    xn: Array
    rstd_x: Array
    logits: Array
    targets: Array
    lse: Array
    weights: Array


class MultiTokenPrediction:
    """The MTP modules of a last stage: :meth:`forward` after the head, :meth:`backward`
    before it; ``weights`` (set by the caller, :func:`mtp_weights`) weigh each module's token
    losses; :meth:`forward` adds the weighted loss to ``loss`` (the caller resets it).
    ``embed``: the embedding parameter's name. The block and head code is the stage's."""

    def __init__(self, cfg, embed: str) -> None:
        self.cfg, self.embed = cfg, embed
        self.weights: list[float] = [1.0] * cfg.mtp_depth
        self.loss = 0.0

    @classmethod
    def of(cls, cfg, embed: str) -> "MultiTokenPrediction | None":
        return cls(cfg, embed) if cfg.mtp_depth > 0 else None

    def units(self, head_units: list[str]) -> list[str]:
        """The units the modules read besides the head's ``head_units``: their blocks, and the
        embedding."""
        return [f"layers.{j}" for j in mtp_layers(self.cfg)] + (
            [] if "embed" in head_units else ["embed"])

    def final_names(self, stage) -> list[str]:
        """The parameters whose gradients the last stage's backward has finished with the
        modules': theirs, and the embedding's copy when the stage does not embed itself (and
        does not hold it as the tied head)."""
        prefixes = tuple(f"layers.{j}." for j in mtp_layers(self.cfg))
        own = [n for n in stage.param_names() if n.startswith(prefixes)]
        return own + ([] if stage.first or stage.head.weight == self.embed else [self.embed])

    def forward(self, stage, params, h: Array, targets: Array, ahead: Array,
                positions) -> list[ModuleSaved]:
        """Every module on the last block's output ``h`` -> their records, adding their
        weighted loss to ``loss``; ``targets`` ``[B, S]`` (``t_{i+1}``, module 1's input
        tokens), ``ahead`` as the module docstring."""
        xp, saved, ids = stage.kernels.xp, [], targets
        for k, j in enumerate(mtp_layers(self.cfg)):
            valid = ahead[k] >= 0
            c, token_loss = self._module_fwd(stage, params, j, h, xp.where(ids >= 0, ids, 0),
                                             xp.where(valid, ahead[k], 0), positions)
            c.weights = valid.reshape(-1) * self.weights[k]
            self.loss += float((c.weights * token_loss).sum())
            saved.append(c)
            h, ids = c.x, ahead[k]
        return saved

    def _module_fwd(self, stage, params, j: int, h: Array, ids: Array, tgt: Array,
                    positions) -> tuple[ModuleSaved, Array]:
        """Module ``j`` (block index) -> (its record, the per-token loss ``[N]``)."""
        ops, cfg, p = stage.kernels, self.cfg, f"layers.{j}."
        e = stage.tp.embed(params, self.embed, ids)
        e = scale_embedding(e, cfg.hidden) if cfg.embed_scale else e
        en, rstd_e = ops.rmsnorm_fwd(e, _norm(params, p + ENORM, cfg), cfg.norm_eps)
        hn, rstd_h = ops.rmsnorm_fwd(h, _norm(params, p + HNORM, cfg), cfg.norm_eps)
        cat = ops.concat([en, hn], axis=-1)
        x_in, = apply_linears(stage.tp, params, [p + EH_PROJ], cat)
        x, block = stage.block.forward(params, j, x_in, positions, bias=stage.moe_bias.get(j))
        if block.moe is not None:           # a sparse block: its balance loss and loads
            stage._count_moe(j, block.moe)
        xn, rstd_x = ops.rmsnorm_fwd(x, _norm(params, p + HEAD_NORM, cfg), cfg.norm_eps)
        logits, = apply_linears(stage.tp, params, [stage.head.weight], xn)
        logits = logits.reshape(-1, logits.shape[-1])
        t = tgt.reshape(-1)
        loss, lse = stage.tp.cross_entropy(logits, t)
        return ModuleSaved(ids, e, rstd_e, h, rstd_h, cat, stage.block.keep(block), x, xn, rstd_x,
                           logits, t, lse, None), loss

    def backward(self, stage, params, grads, saved: list[ModuleSaved], positions, lin,
                 scope) -> Array:
        """Accumulate the modules' gradients (their own, the shared head's and embedding's);
        return the gradient of the last block's output ``h``."""
        ops, cfg, H = stage.kernels, self.cfg, self.cfg.hidden
        dh = None
        for j in reversed(mtp_layers(cfg)):
            c, p = saved.pop(), f"layers.{j}."
            dlogits = stage.tp.cross_entropy_backward(c.logits, c.targets, c.lse, c.weights)
            dxn = apply_linears_backward(stage.tp, [dlogits.astype(c.x.dtype, copy=False)], c.xn,
                                         [stage.head.weight], lin)
            dx, dw = ops.rmsnorm_bwd(dxn, c.x, _norm(params, p + HEAD_NORM, cfg), c.rstd_x)
            grads[p + HEAD_NORM] += dw
            if dh is not None:
                dx = dx + dh
            block = stage.block.restore(params, j, c.block, positions, stage.moe_bias.get(j))
            dx = stage.block.backward(params, grads, j, dx, block, positions, lin, scope,
                                      stage.moe_aux_weight)
            dcat = apply_linears_backward(stage.tp, [dx], c.cat, [p + EH_PROJ], lin)
            de, dw = ops.rmsnorm_bwd(ops.xp.ascontiguousarray(dcat[..., :H]), c.e,
                                     _norm(params, p + ENORM, cfg), c.rstd_e)
            grads[p + ENORM] += dw
            dh, dw = ops.rmsnorm_bwd(ops.xp.ascontiguousarray(dcat[..., H:]), c.h,
                                     _norm(params, p + HNORM, cfg), c.rstd_h)
            grads[p + HNORM] += dw
            de = scale_embedding(de, cfg.hidden) if cfg.embed_scale else de
            stage.tp.embed_backward(grads, self.embed, de, c.ids)
        return dh
