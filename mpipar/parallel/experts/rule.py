"""The mixture of experts' rules with the layout."""
from __future__ import annotations

from mpipar.config import ConfigError
from mpipar.layout import Layout


def check_config(layout: Layout) -> None:
    """The mixture of experts' rules with the layout: the bias update rate and the capacity
    factor are >= 0 and need experts when > 0 (their finiteness:
    :func:`mpipar.config.check_fields`); the sparse FFN runs on whole
    token rows, so not on tp sequence parallelism's token shards; its record is not offloaded."""
    m, p, t = layout.config.model, layout.config.parallel, layout.config.train
    if p.ep < 1:
        raise ConfigError(f"parallel.ep={p.ep}: must be >= 1")
    if m.moe_bias_update_rate < 0:
        raise ConfigError(f"model.moe_bias_update_rate={m.moe_bias_update_rate}: must be >= 0 "
                          "(0: no auxiliary-loss-free balancing)")
    if m.moe_bias_update_rate > 0 and not m.moe_experts:
        raise ConfigError(f"model.moe_bias_update_rate={m.moe_bias_update_rate}: needs a "
                          "mixture of experts (--moe-experts > 0)")
    if not m.moe_capacity_factor >= 0:
        raise ConfigError(f"model.moe_capacity_factor={m.moe_capacity_factor}: must be >= 0 "
                          "(0: dropless)")
    if m.moe_capacity_factor > 0 and not m.moe_experts:
        raise ConfigError(f"model.moe_capacity_factor={m.moe_capacity_factor}: needs a "
                          "mixture of experts (--moe-experts > 0)")
    if p.ep > 1 and not m.moe_experts:
        raise ConfigError(f"parallel.ep={p.ep}: needs a mixture of experts (--moe-experts)")
    if not m.moe_experts:
        return
    if m.moe_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep}: must divide model.moe_experts={m.moe_experts}")
    if (layout.dp * layout.sp) % p.ep:
        raise ConfigError(f"parallel.ep={p.ep}: must divide dp x sp = {layout.dp} x "
                          f"{layout.sp} (the expert-parallel group is carved out of dp x sp)")
    if p.tp_sequence_parallel and p.tp > 1:
        raise ConfigError("model.moe_experts with parallel.tp_sequence_parallel: not supported "
                          "(the sparse FFN needs whole token rows; experts are unsplit by tp)")
    if t.recompute_mode.offloads:
        raise ConfigError(f"model.moe_experts with train.recompute={t.recompute!r}: not "
                          f"supported (use none, selective or full)")
    if m.moe_shared_ffn_hidden % p.tp:   # the shared expert is split as the dense FFN
        raise ConfigError(f"parallel.tp={p.tp}: must divide model.moe_shared_ffn_hidden="
                          f"{m.moe_shared_ffn_hidden}")
