"""KimiConfig: the Kimi Linear family (Kimi Linear, Kimi K3) as the shared layers compute it.

Every difference between the family's members is a typed field here, read by the layers; none is a flag named
after a model. Layer lists are 0-indexed and head sizes derived, so layers never re-read the raw dictionary.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..config import ConfigError, Fields, check_mxfp4


@dataclass(frozen=True, kw_only=True)
class KimiConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int                # dense FFN layers
    rms_norm_eps: float
    kda_layers: tuple[int, ...]
    mla_layers: tuple[int, ...]
    # FFN activation: silu (SwiGLU) or situ, Kimi K3's soft-capped variant
    hidden_act: str = "silu"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel_size: int
    kda_full_rank_gate: bool = False      # output gate g_proj [P, D] instead of g_a_proj / g_b_proj
    kda_output_gate_activation: str = "sigmoid"
    kda_gate_lower_bound: float | None = None   # log-decay = bound * sigmoid(exp(A) * f) instead of -exp(A) softplus(f)
    kda_a_log_padded: bool = False        # A_log stored as head_dim values (per-head values zero-padded: K3)
    kda_a_log_layout: str = "per_head"    # per_channel: entry d decays channel d of every head (the seed's K3 reading)
    # MLA (NoPE)
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_output_gate: bool = False         # sigmoid(g_proj(x)) gates the attention output
    # MoE
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    num_shared_experts: int
    moe_renormalize: bool
    routed_scaling_factor: float
    num_expert_group: int
    topk_group: int
    first_k_dense_replace: int
    moe_layer_freq: int
    # The released Kimi Linear remote code gathers bias-corrected router scores as weights (an in-place aliasing
    # bug); transformers, vLLM, SGLang, llama.cpp and Kimi K3 use the plain sigmoid scores. Default: plain.
    router_bias_in_weights: bool = False
    routed_expert_hidden_size: int | None = None   # latent MoE: experts run in this width, between down / up proj
    latent_moe_norm: bool = False
    expert_input_mxfp8: bool = False      # MXFP8 quantize-dequantize routed-expert inputs, as the seed system does
    attn_res_block_size: int = 0          # Block Attention Residuals (0: plain residual stream)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    max_position_embeddings: int = 1 << 20
    torch_dtype: str = "bfloat16"
    quantization: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def experts_mxfp4(self) -> bool:
        """Routed experts stored as compressed-tensors MXFP4 (weight_packed / weight_scale)."""
        return self.quantization is not None

    @property
    def kda_proj_size(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def expert_width(self) -> int:
        """The width routed experts read and write: the latent width, or the model width."""
        return self.routed_expert_hidden_size or self.hidden_size

    def is_kda(self, layer: int) -> bool:
        return layer in self.kda_layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def tp_dims(self) -> dict[str, int]:
        """Sizes the tensor-parallel plan splits; each must divide by the number of ranks."""
        dims = {
            "linear_attn_config.num_heads (KDA heads)": self.kda_num_heads,
            "num_attention_heads (MLA heads)": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "vocab_size": self.vocab_size,
        }
        if self.routed_expert_hidden_size:     # latent down / up projections are split along their inputs
            dims["hidden_size (latent MoE down projection)"] = self.hidden_size
            dims["routed_expert_hidden_size"] = self.routed_expert_hidden_size
        if self.experts_mxfp4:                 # a rank's share of w2's input must be whole MXFP4 blocks
            dims["moe_intermediate_size / 32 (MXFP4 blocks, never split)"] = self.moe_intermediate_size // 32
        return dims

    def with_(self, **changes: Any) -> "KimiConfig":
        return replace(self, **changes)


def parse_kimi(raw: dict[str, Any], a_log_padded: bool = False) -> KimiConfig:
    """A Kimi Linear family text config (model_type kimi_linear), with any hf_overrides already merged in."""
    f = Fields(raw)
    if raw.get("model_type") != "kimi_linear":
        raise ConfigError(f"model_type: {raw.get('model_type')!r} is not supported (expected 'kimi_linear')")
    n_layers = f.positive("num_hidden_layers")
    lin = Fields(f.get("linear_attn_config", kind=dict), "linear_attn_config.")
    kda, full = lin.raw.get("kda_layers"), lin.raw.get("full_attn_layers")
    if not isinstance(kda, list) or not isinstance(full, list):
        raise ConfigError("linear_attn_config: needs the lists 'kda_layers' and 'full_attn_layers' (1-indexed)")
    kda0, full0 = sorted(i - 1 for i in kda), sorted(i - 1 for i in full)
    if sorted(kda0 + full0) != list(range(n_layers)):
        raise ConfigError("linear_attn_config: kda_layers and full_attn_layers (1-indexed) must together "
                          f"name each of the {n_layers} layers exactly once")
    if not f.flag("mla_use_nope", True):
        raise ConfigError("mla_use_nope: false (MLA with RoPE) is not supported; the Kimi family uses NoPE MLA")
    f.choice("moe_router_activation_func", ("sigmoid",), "sigmoid")
    if raw.get("attention_bias"):
        raise ConfigError("attention_bias: true is not supported by Kimi checkpoints")
    q_lora = raw.get("q_lora_rank")
    if q_lora is not None and (not isinstance(q_lora, int) or isinstance(q_lora, bool) or q_lora <= 0):
        raise ConfigError(f"q_lora_rank: {q_lora!r} must be null or a positive integer")
    heads = f.positive("num_attention_heads")
    kv_heads = raw.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise ConfigError(f"num_key_value_heads: {kv_heads} must equal num_attention_heads ({heads}) for MLA")
    n_experts = f.positive("num_experts", raw.get("num_local_experts", ...))
    groups = f.positive("num_expert_group", 1) if raw.get("use_grouped_topk", True) else 1
    topk_group = f.positive("topk_group", 1) if groups > 1 else 1
    if n_experts % groups or topk_group > groups or (groups > 1 and n_experts // groups < 2):
        raise ConfigError(f"num_expert_group: {groups} groups (topk_group {topk_group}) do not fit {n_experts} experts")
    top_k = f.positive("num_experts_per_token", raw.get("num_experts_per_tok", ...))
    if top_k > n_experts:
        raise ConfigError(f"num_experts_per_token: {top_k} exceeds num_experts ({n_experts})")
    kda_heads, head_dim = lin.positive("num_heads"), lin.positive("head_dim")
    layout = f.choice("kda_a_log_layout", ("per_head", "per_channel"), "per_head")
    if layout == "per_channel" and not a_log_padded:
        raise ConfigError("kda_a_log_layout: 'per_channel' needs A_log stored with head_dim values (the Kimi K3 "
                          "layout); this checkpoint stores one value per head")
    if a_log_padded and kda_heads > head_dim:
        raise ConfigError(f"linear_attn_config.num_heads: {kda_heads} heads cannot be padded into A_log's "
                          f"head_dim ({head_dim}) values")
    bound = lin.get("gate_lower_bound", None, (int, float))
    latent = f.positive("routed_expert_hidden_size", None)
    moe_intermediate = f.positive("moe_intermediate_size")
    hidden = f.positive("hidden_size")
    quant = raw.get("quantization_config")
    if quant is not None:
        check_mxfp4(quant, {"routed_expert_hidden_size" if latent else "hidden_size": latent or hidden,
                            "moe_intermediate_size": moe_intermediate})
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return KimiConfig(
        vocab_size=f.positive("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        intermediate_size=f.positive("intermediate_size"),
        rms_norm_eps=f.number("rms_norm_eps", 1e-5),
        kda_layers=tuple(kda0),
        mla_layers=tuple(full0),
        hidden_act=f.choice("hidden_act", ("silu", "situ"), "silu"),
        situ_beta=f.number("activation_situ_beta", 4.0),
        situ_linear_beta=f.number("activation_situ_linear_beta", 25.0),
        kda_num_heads=kda_heads,
        kda_head_dim=head_dim,
        conv_kernel_size=lin.positive("short_conv_kernel_size"),
        kda_full_rank_gate=lin.flag("use_full_rank_gate", False),
        kda_output_gate_activation=f.choice("kda_output_gate_activation", ("sigmoid", "silu"), "sigmoid"),
        kda_gate_lower_bound=None if not bound else float(bound),
        kda_a_log_padded=a_log_padded,
        kda_a_log_layout=layout,
        num_attention_heads=heads,
        q_lora_rank=q_lora,
        kv_lora_rank=f.positive("kv_lora_rank"),
        qk_nope_head_dim=f.positive("qk_nope_head_dim"),
        qk_rope_head_dim=f.positive("qk_rope_head_dim"),
        v_head_dim=f.positive("v_head_dim"),
        mla_output_gate=f.flag("mla_use_output_gate", False),
        num_experts=n_experts,
        num_experts_per_token=top_k,
        moe_intermediate_size=moe_intermediate,
        num_shared_experts=f.get("num_shared_experts", raw.get("n_shared_experts", 0)),
        moe_renormalize=bool(raw.get("moe_renormalize", raw.get("norm_topk_prob", True))),
        routed_scaling_factor=f.number("routed_scaling_factor", 1.0),
        num_expert_group=groups,
        topk_group=topk_group,
        first_k_dense_replace=f.get("first_k_dense_replace", 0),
        moe_layer_freq=f.positive("moe_layer_freq", 1),
        router_bias_in_weights=f.flag("router_bias_in_weights", False),
        routed_expert_hidden_size=latent,
        latent_moe_norm=f.flag("latent_moe_use_norm", False),
        expert_input_mxfp8=f.flag("expert_input_mxfp8", False),
        attn_res_block_size=f.get("attn_res_block_size", 0),
        tie_word_embeddings=f.flag("tie_word_embeddings", False),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=raw.get("pad_token_id"),
        max_position_embeddings=int(raw.get("model_max_length") or raw.get("max_position_embeddings") or 1 << 20),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
        quantization=quant,
    )
