"""Tensor parallelism: the sharding plan (which checkpoint tensors split along which dimension) and its checks.

Megatron style, by checkpoint name: KDA q/k/v and their conv taps, f_b/g_b, dt_bias, A_log and beta split by
head; MLA q (or q_b) and kv_b split by head; routed experts, shared experts and dense MLPs split along their
intermediate dimension (gate/up rows, down columns); embedding and LM head split by vocabulary. Every
output projection (o_proj, down) is row-parallel, so one all-reduce follows each mixer and each FFN. The
low-rank down projections (f_a, g_a, kv_a, q_a), their norms, the router and all RMSNorms are replicated.
"""
from __future__ import annotations

import re

from .config import ConfigError, ModelConfig

SPLIT_RULES: tuple[tuple[re.Pattern, int], ...] = tuple((re.compile(p), d) for p, d in (
    (r"self_attn\.[qkv]_proj\.weight$", 0),
    (r"self_attn\.[qkv]_conv1d\.weight$", 0),
    (r"self_attn\.[fg]_b_proj\.weight$", 0),
    (r"self_attn\.b_proj\.weight$", 0),
    (r"self_attn\.dt_bias$", 0),
    (r"self_attn\.A_log$", 2),
    (r"self_attn\.q_b_proj\.weight$", 0),
    (r"self_attn\.kv_b_proj\.weight$", 0),
    (r"self_attn\.o_proj\.weight$", 1),
    (r"(mlp|shared_experts)\.(gate|up)_proj\.weight$", 0),
    (r"(mlp|shared_experts)\.down_proj\.weight$", 1),
    (r"experts\.\d+\.w[13]\.weight(_packed|_scale)?$", 0),
    (r"experts\.\d+\.w2\.weight(_packed|_scale)?$", 1),
    (r"(embed_tokens|lm_head)\.weight$", 0),
))


def split_dim(name: str) -> int | None:
    """The dimension along which `name` is split across ranks, or None if every rank holds all of it."""
    return next((d for pattern, d in SPLIT_RULES if pattern.search(name)), None)


def check_divisible(cfg: ModelConfig, tp: int) -> None:
    """Refuse, before loading anything, a configuration whose split dimensions do not divide by tp."""
    dims = {
        "linear_attn_config.num_heads (KDA heads)": cfg.kda_num_heads,
        "num_attention_heads (MLA heads)": cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "vocab_size": cfg.vocab_size,
    }
    for name, value in dims.items():
        if value % tp:
            raise ConfigError(f"{name} = {value} is not divisible by {tp} (tensor_parallel_size)")
    if cfg.experts_mxfp4 and (cfg.moe_intermediate_size // tp) % 32:
        raise ConfigError(f"moe_intermediate_size / tensor_parallel_size = {cfg.moe_intermediate_size // tp} must be a "
                          "multiple of 32 so MXFP4 blocks are not split")
