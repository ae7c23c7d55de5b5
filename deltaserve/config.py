"""ModelConfig: the parts of a Hugging Face `config.json` that deltaserve computes with.

Only what the math needs is kept, already resolved (0-indexed layer kinds, derived head sizes), so model
code never re-reads the raw dictionary. Anything we cannot compute exactly is refused here, naming the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that deltaserve cannot serve; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    rms_norm_eps: float
    kda_layers: tuple[int, ...]          # 0-indexed
    mla_layers: tuple[int, ...]          # 0-indexed
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel_size: int
    # MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
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
    # The released remote code gathers bias-corrected router scores as weights (an in-place aliasing bug);
    # transformers, vLLM, SGLang and llama.cpp use the plain sigmoid scores. Default: plain.
    router_bias_in_weights: bool = False
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

    def is_kda(self, layer: int) -> bool:
        return layer in self.kda_layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any], overrides: dict[str, Any] | None = None) -> "ModelConfig":
        raw = {**raw, **(overrides or {})}
        if raw.get("model_type") != "kimi_linear":
            raise ConfigError(f"model_type: {raw.get('model_type')!r} is not supported (expected 'kimi_linear')")

        def get(name: str, default: Any = ..., kind: type | tuple[type, ...] = int) -> Any:
            if raw.get(name) is None:
                if default is ...:
                    raise ConfigError(f"{name}: missing from config.json")
                return default
            value = raw[name]
            if kind is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is int):
                raise ConfigError(f"{name}: {value!r} is not a valid {getattr(kind, '__name__', kind)}")
            return value

        def positive(name: str, default: Any = ...) -> int:
            value = get(name, default)
            if value <= 0:
                raise ConfigError(f"{name}: {value!r} must be a positive integer")
            return value

        n_layers = positive("num_hidden_layers")
        lin = get("linear_attn_config", kind=dict)
        kda, full = lin.get("kda_layers"), lin.get("full_attn_layers")
        if not isinstance(kda, list) or not isinstance(full, list):
            raise ConfigError("linear_attn_config: needs the lists 'kda_layers' and 'full_attn_layers' (1-indexed)")
        kda0, full0 = sorted(i - 1 for i in kda), sorted(i - 1 for i in full)
        if sorted(kda0 + full0) != list(range(n_layers)):
            raise ConfigError("linear_attn_config: kda_layers and full_attn_layers (1-indexed) must together "
                              f"name each of the {n_layers} layers exactly once")
        if not raw.get("mla_use_nope", True):
            raise ConfigError("mla_use_nope: false (MLA with RoPE) is not supported; Kimi Linear uses NoPE MLA")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act: {act!r} is not supported (expected 'silu')")
        router = raw.get("moe_router_activation_func", "sigmoid")
        if router != "sigmoid":
            raise ConfigError(f"moe_router_activation_func: {router!r} is not supported (expected 'sigmoid')")
        for name in ("attention_bias",):
            if raw.get(name):
                raise ConfigError(f"{name}: true is not supported by Kimi Linear checkpoints")
        q_lora = raw.get("q_lora_rank")
        if q_lora is not None and (not isinstance(q_lora, int) or q_lora <= 0):
            raise ConfigError(f"q_lora_rank: {q_lora!r} must be null or a positive integer")
        heads = positive("num_attention_heads")
        kv_heads = raw.get("num_key_value_heads") or heads
        if kv_heads != heads:
            raise ConfigError(f"num_key_value_heads: {kv_heads} must equal num_attention_heads ({heads}) for MLA")
        n_experts = positive("num_experts", raw.get("num_local_experts", ...))
        groups = positive("num_expert_group", 1) if raw.get("use_grouped_topk", True) else 1
        topk_group = positive("topk_group", 1) if groups > 1 else 1
        if n_experts % groups or topk_group > groups or (groups > 1 and n_experts // groups < 2):
            raise ConfigError(f"num_expert_group: {groups} groups (topk_group {topk_group}) do not fit {n_experts} experts")
        top_k = positive("num_experts_per_token", raw.get("num_experts_per_tok", ...))
        if top_k > n_experts:
            raise ConfigError(f"num_experts_per_token: {top_k} exceeds num_experts ({n_experts})")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        quant = raw.get("quantization_config")
        if quant is not None:
            _check_mxfp4(quant, raw)
        return cls(
            vocab_size=positive("vocab_size"),
            hidden_size=positive("hidden_size"),
            num_hidden_layers=n_layers,
            intermediate_size=positive("intermediate_size"),
            rms_norm_eps=float(get("rms_norm_eps", 1e-5, (int, float))),
            kda_layers=tuple(kda0),
            mla_layers=tuple(full0),
            kda_num_heads=_pos(lin, "num_heads", "linear_attn_config.num_heads"),
            kda_head_dim=_pos(lin, "head_dim", "linear_attn_config.head_dim"),
            conv_kernel_size=_pos(lin, "short_conv_kernel_size", "linear_attn_config.short_conv_kernel_size"),
            num_attention_heads=heads,
            q_lora_rank=q_lora,
            kv_lora_rank=positive("kv_lora_rank"),
            qk_nope_head_dim=positive("qk_nope_head_dim"),
            qk_rope_head_dim=positive("qk_rope_head_dim"),
            v_head_dim=positive("v_head_dim"),
            num_experts=n_experts,
            num_experts_per_token=top_k,
            moe_intermediate_size=positive("moe_intermediate_size"),
            num_shared_experts=get("num_shared_experts", raw.get("n_shared_experts", 0)),
            moe_renormalize=bool(raw.get("moe_renormalize", raw.get("norm_topk_prob", True))),
            routed_scaling_factor=float(get("routed_scaling_factor", 1.0, (int, float))),
            num_expert_group=groups,
            topk_group=topk_group,
            first_k_dense_replace=get("first_k_dense_replace", 0),
            moe_layer_freq=positive("moe_layer_freq", 1),
            router_bias_in_weights=bool(raw.get("router_bias_in_weights", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=raw.get("pad_token_id"),
            max_position_embeddings=int(raw.get("model_max_length") or raw.get("max_position_embeddings") or 1 << 20),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            quantization=quant,
        )

    @classmethod
    def from_path(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "ModelConfig":
        file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
        try:
            raw = json.loads(file.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{file}: no config.json found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}: not valid JSON ({e})") from None
        if "text_config" in raw and raw.get("model_type") != "kimi_linear":
            raw = raw["text_config"]
        return cls.from_dict(raw, overrides)

    def with_(self, **changes: Any) -> "ModelConfig":
        return replace(self, **changes)


def _pos(d: dict[str, Any], key: str, name: str) -> int:
    value = d.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name}: {value!r} must be a positive integer")
    return value


MXFP4_FORMAT = "mxfp4-pack-quantized"


def _check_mxfp4(quant: Any, raw: dict[str, Any]) -> None:
    """Only compressed-tensors MXFP4 routed experts (weights only, groups of 32) are understood."""
    if not isinstance(quant, dict) or quant.get("quant_method") != "compressed-tensors" \
            or quant.get("format") != MXFP4_FORMAT:
        fmt = quant.get("format") if isinstance(quant, dict) else quant
        raise ConfigError(f"quantization_config: {fmt!r} is not supported (deltaserve reads compressed-tensors "
                          f"'{MXFP4_FORMAT}' routed experts)")
    for name, group in (quant.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("num_bits", 4) != 4 or w.get("group_size", 32) != 32 or w.get("type", "float") != "float":
            raise ConfigError(f"quantization_config.config_groups.{name}.weights: only 4-bit float in groups of 32 "
                              "(MXFP4) is supported")
        if group.get("input_activations"):
            raise ConfigError(f"quantization_config.config_groups.{name}.input_activations: activation quantization "
                              "is not supported (weights-only MXFP4)")
    for name in ("hidden_size", "moe_intermediate_size"):
        if raw.get(name, 0) % 32:
            raise ConfigError(f"{name}: {raw.get(name)} must be a multiple of 32 for MXFP4 experts")
