"""The model's fields (``[model]``, names after Hugging Face's configs where they map) and
their own rules."""
from __future__ import annotations

from dataclasses import dataclass

from mpipar.config.schema import LayerSet, described as _f, positive, require
from mpipar.model.activation import FFN_ACTIVATIONS, FfnActivation
from mpipar.model.norms import NORM_PLACEMENTS, NormPlacement
from mpipar.model.rope import ROPE_TYPES, RopeScaling
from mpipar.model.router import ROUTERS, Router


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
                                   "low/high-frequency rule), yarn (YaRN: interpolation and "
                                   "extrapolation blended over a correction range, the "
                                   "tables scaled by its attention factor)",
                        choices=ROPE_TYPES)
    rope_factor: float = _f(1.0, "RoPE scaling factor (linear, dynamic, llama3, yarn); 1 with "
                                 "default")
    rope_low_freq_factor: float = _f(1.0, "llama3 RoPE: frequencies whose wavelength exceeds "
                                          "rope_original_max_positions / this are divided by "
                                          "rope_factor")
    rope_high_freq_factor: float = _f(4.0, "llama3 RoPE: frequencies whose wavelength is below "
                                           "rope_original_max_positions / this are kept (those "
                                           "between the two bounds are interpolated)")
    rope_original_max_positions: int = _f(0, "pretraining context of a scaled RoPE (llama3, "
                                             "yarn: original_max_position_embeddings; dynamic: "
                                             "max_position_embeddings)")
    rope_beta_fast: float = _f(32.0, "yarn RoPE: dimensions turning more than this many times "
                                     "over the pretraining context are kept (beta_fast)")
    rope_beta_slow: float = _f(1.0, "yarn RoPE: dimensions turning fewer than this many times "
                                    "over the pretraining context are divided by rope_factor "
                                    "(beta_slow; those between are blended)")
    rope_mscale: float = _f(0.0, "yarn RoPE: the attention factor's numerator weight (mscale; "
                                 "0 = unset: the factor is 0.1 ln(rope_factor) + 1)")
    rope_mscale_all_dim: float = _f(0.0, "yarn RoPE: the attention factor's denominator weight "
                                         "(mscale_all_dim; 0 = unset); latent attention also "
                                         "multiplies its softmax scale by (0.1 this "
                                         "ln(rope_factor) + 1)^2")
    tie_embeddings: bool = _f(False, "the LM head is the embedding matrix: one parameter "
                                     "(tie_word_embeddings), a copy on the first and the last "
                                     "pipeline stage whose gradients are summed")
    attention_bias: bool = _f(False, "q, k and v projections have biases (Qwen2)")
    qk_norm: bool = _f(False, "RMSNorm over each head's queries and keys before RoPE, one "
                              "weight of head_dim for all query heads and one for all key "
                              "heads (Qwen3's q_norm and k_norm)")
    latent_kv_rank: int = _f(0, "multi-head latent attention (DeepSeek-V3's kv_lora_rank): keys "
                                "and values from one compressed latent of this width per token "
                                "with its own RMSNorm, plus a RoPE key of rope_head_dim shared "
                                "by the heads; head_dim is then a query/key head's nope + rope "
                                "width; 0 = standard attention")
    latent_q_rank: int = _f(0, "latent attention: queries through a low-rank projection of this "
                               "width with its own RMSNorm (q_lora_rank); 0 = one q_proj")
    rope_head_dim: int = _f(0, "latent attention: the rotated part of a query/key head "
                               "(qk_rope_head_dim), the last rope_head_dim of head_dim")
    v_head_dim: int = _f(0, "latent attention: width of a value head (v_head_dim); 0 means "
                            "head_dim")
    norm_eps: float = _f(1e-5, "RMSNorm epsilon")
    norm_placement: str = _f("pre", "where a block's RMSNorms sit: pre (Llama: before attention "
                                    "and before the FFN), sandwich (Gemma 2/3: also on the "
                                    "attention's and the FFN's outputs before each joins the "
                                    "residual stream)", choices=NORM_PLACEMENTS)
    norm_unit_offset: bool = _f(False, "every RMSNorm multiplies by (1 + w) instead of w, its "
                                       "weights starting at 0 (Gemma)")
    embed_scale: bool = _f(False, "the embedding's output is multiplied by sqrt(hidden), rounded "
                                  "to float32 and then to the activations' dtype (Gemma)")
    ffn_activation: str = _f("silu", "the FFN's gated activation: silu (SwiGLU), gelu_tanh (GeGLU "
                                     "with tanh-approximated GELU, Gemma's gelu_pytorch_tanh)",
                             choices=FFN_ACTIVATIONS)
    query_pre_attn_scalar: float = _f(0.0, "attention scores are scaled by 1/sqrt(this) (Gemma's "
                                           "query_pre_attn_scalar); 0 = head_dim")
    init_std: float = _f(0.02, "standard deviation of the normal weight initialisation")
    sliding_window: int = _f(0, "sliding-window attention: a token sees itself and the W-1 "
                                "tokens before it (Mistral's sliding_window); 0 = full causal")
    window_layers: str = _f("all", "the layers that use --sliding-window: all, even (layers 0, 2, "
                                   "... local, the others global, as Gemma 2), odd, or a comma "
                                   "list of layer indices")
    rope_local_theta: float = _f(0.0, "RoPE base of the sliding-window layers, unscaled (Gemma 3's "
                                      "rope_local_base_freq); 0 = those layers use rope_theta and "
                                      "rope_type as the others")

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
    moe_router: str = _f("softmax", "mixture of experts: the router: softmax (Mixtral's: top K of "
                                    "the softmax probabilities) or grouped_sigmoid (DeepSeek-V3's: "
                                    "sigmoid scores, top K within the best moe_topk_groups of "
                                    "moe_groups expert groups)", choices=ROUTERS)
    moe_groups: int = _f(1, "mixture of experts, grouped_sigmoid router: expert groups (n_group)")
    moe_topk_groups: int = _f(1, "mixture of experts, grouped_sigmoid router: groups a token's "
                                 "experts are chosen in (topk_group), the groups of the largest "
                                 "sum of their two best scores")
    moe_routed_scale: float = _f(1.0, "mixture of experts: the routed experts' weights multiplied "
                                      "by this (routed_scaling_factor)")
    mtp_depth: int = _f(0, "multi-token prediction (DeepSeek-V3's num_nextn_predict_layers): D "
                           "modules after the last block, module k predicting the token k + 1 "
                           "ahead through the shared embedding and LM head; 0 = off")
    mtp_loss_coef: float = _f(0.3, "multi-token prediction: weight lambda of the modules' mean "
                                   "loss, L_MTP = lambda / D * sum of the modules' mean token "
                                   "losses (0.3: the DeepSeek-V3 report's value for its first "
                                   "10T tokens; 0.1 after)")

    def sparse_set(self) -> LayerSet:
        """The blocks ``moe_layers`` names (whether or not ``moe_experts`` makes them sparse)."""
        return LayerSet.parse(self.moe_layers, "moe_layers", self.layers)

    def window_set(self) -> LayerSet:
        """The blocks ``window_layers`` names (whether or not ``sliding_window`` is set)."""
        return LayerSet.parse(self.window_layers, "window_layers", self.layers)

    @property
    def router(self) -> Router:
        """The :class:`~mpipar.model.router.Router` ``moe_router`` names."""
        return Router.named(self.moe_router)

    @property
    def latent(self) -> bool:
        """Whether attention is multi-head latent attention (``latent_kv_rank`` > 0)."""
        return self.latent_kv_rank > 0

    @property
    def rope_dim(self) -> int:
        """The width RoPE rotates in a query/key head: ``rope_head_dim`` under latent attention,
        else the whole ``head_dim``."""
        return self.rope_head_dim if self.latent else self.head_dim

    @property
    def value_dim(self) -> int:
        """The width of a value head: ``v_head_dim`` under latent attention (0: head_dim)."""
        return self.v_head_dim if self.latent and self.v_head_dim else self.head_dim

    @property
    def norms(self) -> NormPlacement:
        """The :class:`~mpipar.model.norms.NormPlacement` ``norm_placement`` names."""
        return NormPlacement.named(self.norm_placement)

    @property
    def activation(self) -> FfnActivation:
        """The :class:`~mpipar.model.activation.FfnActivation` ``ffn_activation`` names."""
        return FfnActivation.named(self.ffn_activation)

    def local_rope(self, layer: int) -> bool:
        """Whether block ``layer`` rotates with ``rope_local_theta`` (unscaled): it is set and
        the layer has a sliding window."""
        return self.rope_local_theta > 0 and self.layer_window(layer) > 0

    @property
    def rope(self) -> RopeScaling:
        """The :class:`~mpipar.model.rope.RopeScaling` ``rope_type`` names."""
        return RopeScaling.named(self.rope_type)

    def is_sparse(self, layer: int) -> bool:
        """Whether block ``layer``'s FFN is a mixture of experts (``moe_experts`` > 0 and
        ``moe_layers`` names it); a multi-token prediction module's block (``layer`` >=
        ``layers``) is of the last block's kind, as DeepSeek-V3's."""
        layer = min(layer, self.layers - 1)
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


def check_moe_fields(m: ModelConfig) -> None:
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
    require(m.moe_routed_scale > 0,
            f"model.moe_routed_scale={m.moe_routed_scale}: must be > 0")
    m.router.check(m)


def check_latent_fields(m: ModelConfig) -> None:
    """Latent attention's own rules (``latent_kv_rank`` > 0; else its other fields stay 0)."""
    for name in ("latent_kv_rank", "latent_q_rank", "rope_head_dim", "v_head_dim"):
        require(getattr(m, name) >= 0, f"model.{name}={getattr(m, name)}: must be >= 0")
    if not m.latent:
        require(m.latent_q_rank == m.rope_head_dim == m.v_head_dim == 0,
                f"model.latent_q_rank={m.latent_q_rank}, rope_head_dim={m.rope_head_dim}, "
                f"v_head_dim={m.v_head_dim}: latent attention's fields need "
                f"model.latent_kv_rank > 0")
        return
    require(m.rope_head_dim > 0 and m.rope_head_dim % 2 == 0,
            f"model.rope_head_dim={m.rope_head_dim}: latent attention needs an even width > 0 "
            f"(RoPE rotates pairs)")
    require(m.rope_head_dim < m.head_dim,
            f"model.rope_head_dim={m.rope_head_dim}: must be < head_dim={m.head_dim} (a "
            f"query/key head is its nope part then its rope part)")
    require(m.value_dim <= m.head_dim,
            f"model.v_head_dim={m.v_head_dim}: must be <= head_dim={m.head_dim} (values are "
            f"attended as zero-padded query/key-width heads)")
    require(m.kv_heads == m.heads,
            f"model.kv_heads={m.kv_heads}: latent attention expands keys and values for every "
            f"query head (must equal heads={m.heads})")
    require(not m.attention_bias and not m.qk_norm,
            f"model.attention_bias={m.attention_bias}, qk_norm={m.qk_norm}: latent attention "
            f"has neither (both must be off)")


def check_window_fields(m: ModelConfig) -> None:
    """``sliding_window`` is >= 0; ``window_layers`` is all, even, odd or a list of layers."""
    require(m.sliding_window >= 0,
            f"model.sliding_window={m.sliding_window}: must be >= 0 (0 = full causal)")
    m.window_set()                  # window_layers parses: ConfigError names the value and the rule
    require(m.rope_local_theta >= 0,
            f"model.rope_local_theta={m.rope_local_theta}: must be >= 0 (0 = rope_theta)")
    require(m.rope_local_theta == 0 or m.sliding_window > 0,
            f"model.rope_local_theta={m.rope_local_theta}: applies to the sliding-window layers "
            f"and model.sliding_window is 0 (set it, or rope_local_theta 0)")


def check_rope_scaling(m: ModelConfig) -> None:
    """The RoPE scaling fields' own rules (a factor only with a scaling type; llama3's bounds)."""
    rope = m.rope
    if not rope.scales:
        require(m.rope_factor == 1.0,
                f"model.rope_factor={m.rope_factor}: scales only with model.rope_type linear, "
                f"dynamic, llama3 or yarn (rope_type is {m.rope_type!r})")
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
    check_yarn_fields(m)


def check_yarn_fields(m: ModelConfig) -> None:
    """yarn's fields: set only with rope_type yarn; 0 < beta_slow < beta_fast; mscales >= 0."""
    yarn = ("rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim")
    if not m.rope.correction_range:
        changed = [f"model.{n}={getattr(m, n)}" for n in yarn
                   if getattr(m, n) != ModelConfig.__dataclass_fields__[n].default]
        require(not changed, f"{', '.join(changed)}: only with model.rope_type yarn "
                             f"(rope_type is {m.rope_type!r})")
        return
    require(0 < m.rope_beta_slow < m.rope_beta_fast,
            f"model.rope_beta_fast={m.rope_beta_fast}, model.rope_beta_slow={m.rope_beta_slow}: "
            f"yarn RoPE needs 0 < beta_slow < beta_fast")
    for name in ("rope_mscale", "rope_mscale_all_dim"):
        require(getattr(m, name) >= 0, f"model.{name}={getattr(m, name)}: must be >= 0 (0 = unset)")


CHECKPOINT_OVERRIDABLE = ("init_std", "moe_bias_update_rate", "moe_aux_loss_coef",
                          "moe_capacity_factor", "mtp_loss_coef")


def check_model(m: ModelConfig, head_dim_given: bool) -> None:
    """The model fields' own rules, on ``m`` with its derived defaults filled in;
    ``head_dim_given``: the user set ``head_dim`` (then ``hidden`` need not divide by ``heads``)."""
    positive(m, ("vocab_size", "hidden", "layers", "heads", "kv_heads", "head_dim",
                 "ffn_hidden"), "model")
    require(m.vocab_size >= 2, f"model.vocab_size={m.vocab_size}: must be at least 2")
    require(head_dim_given or m.hidden % m.heads == 0,
            f"model.hidden={m.hidden}: must be divisible by model.heads={m.heads} "
            f"(or set model.head_dim)")
    require(m.head_dim % 2 == 0, f"model.head_dim={m.head_dim}: must be even (RoPE rotates pairs)")
    require(m.heads % m.kv_heads == 0,
            f"model.kv_heads={m.kv_heads}: must divide model.heads={m.heads}")
    require(m.rope_theta > 0, f"model.rope_theta={m.rope_theta}: must be > 0")
    check_rope_scaling(m)
    require(m.norm_eps > 0, f"model.norm_eps={m.norm_eps}: must be > 0")
    require(m.init_std > 0, f"model.init_std={m.init_std}: must be > 0")
    check_window_fields(m)
    check_latent_fields(m)
    check_moe_fields(m)
    require(m.mtp_depth >= 0, f"model.mtp_depth={m.mtp_depth}: must be >= 0 (0: no multi-token "
            f"prediction)")
    require(m.mtp_loss_coef >= 0, f"model.mtp_loss_coef={m.mtp_loss_coef}: must be >= 0")
    require(m.query_pre_attn_scalar >= 0, f"model.query_pre_attn_scalar="
            f"{m.query_pre_attn_scalar}: must be >= 0 (0 = head_dim)")
    require(m.ffn_activation == "silu" or m.moe_experts == 0,
            f"model.ffn_activation={m.ffn_activation!r}: the experts' FFN is SwiGLU (silu); a "
            f"mixture of experts (moe_experts={m.moe_experts}) needs ffn_activation 'silu'")
