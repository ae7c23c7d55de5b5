"""`deltaserve make-tiny`: a small random Kimi Linear checkpoint in the official layout (config.json,
sharded safetensors with the original tensor names, index), deterministic for a seed."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .checkpoint import INDEX
from .config import ModelConfig

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 5,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3, 5], "head_dim": 16, "num_heads": 2,
                           "short_conv_kernel_size": 4},
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "model_max_length": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "initializer_range": 0.02,
    "use_cache": True,
    "dtype": "bfloat16",
}
# Presets for make-tiny: "tiny" for tests, "bench" a model big enough for meaningful CPU timings
# (hidden 1024, 12 layers of which 3 MLA, 32 experts of 512, Kimi's 163,840-token vocabulary).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "bench": dict(vocab_size=163840, hidden_size=1024, intermediate_size=4096, moe_intermediate_size=512,
                  num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=8, head_dim=128, kv_lora_rank=512,
                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=32, num_experts_per_token=4,
                  linear_attn_config={"full_attn_layers": [4, 8, 12], "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11],
                                      "head_dim": 128, "num_heads": 8, "short_conv_kernel_size": 4},
                  bos_token_id=163584, eos_token_id=163586, pad_token_id=163839, model_max_length=8192),
}
FP32_TENSORS = ("A_log", "dt_bias", "e_score_correction_bias")


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Weights scaled so activations stay O(1) through every layer, making parity tests sensitive."""
    randn = lambda: torch.randn(shape, generator=gen)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1, 16, generator=gen).log()
    if name.endswith("dt_bias"):
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
        return dt + torch.log(-torch.expm1(-dt))           # inverse softplus
    if name.endswith("e_score_correction_bias"):
        return 0.1 * randn()
    if "norm" in name:
        return 1.0 + 0.1 * randn()
    if "conv1d" in name:
        return 0.5 * randn()
    if name.endswith("embed_tokens.weight"):
        return randn()
    return randn() / math.sqrt(shape[-1])


def make_tiny(dst: str | Path, seed: int = 0, dtype: str = "bfloat16", shards: int = 2, preset: str = "tiny",
              **overrides: Any) -> Path:
    """Write the checkpoint; `overrides` replace top-level config.json fields of the preset."""
    from .models.kimi_linear import KimiLinearForCausalLM
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    raw = {**TINY_CONFIG, **PRESETS[preset], **overrides, "dtype": dtype}
    cfg = ModelConfig.from_dict(raw)
    with torch.device("meta"):
        names = {n: tuple(t.shape) for n, t in KimiLinearForCausalLM(cfg).checkpoint_map().items()}
    gen = torch.Generator().manual_seed(seed)
    store = getattr(torch, dtype)
    tensors = {n: random_tensor(n, names[n], gen).to(torch.float32 if n.endswith(FP32_TENSORS) else store)
               for n in sorted(names)}
    # Split by layer, as published checkpoints are: consecutive layers per shard, globals in the last.
    layer_of = lambda n: int(n.split(".")[2]) if n.startswith("model.layers.") else cfg.num_hidden_layers
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {n: files[min(layer_of(n) * shards // (cfg.num_hidden_layers + 1), shards - 1)] for n in tensors}
    for file in files:
        save_file({n: t.contiguous() for n, t in tensors.items() if weight_map[n] == file}, dst / file,
                  metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    return dst
