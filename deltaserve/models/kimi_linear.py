"""Kimi Linear: KDA and NoPE-MLA token mixers, dense and MoE channel mixers, assembled.

`forward(tokens, state)` appends `tokens` ([B, T]) to the sequences in `state` and returns next-token logits.
Module attribute names follow the official checkpoint, so the checkpoint map is mostly the parameter names.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..layers.kda import KimiDeltaAttention
from ..layers.mla import MLAttention
from ..layers.mlp import SwiGLU, param
from ..layers.moe import MoE
from ..layers.norm import RMSNorm
from ..state import StateView


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, dtype: torch.dtype):
        super().__init__()
        self.is_kda = cfg.is_kda(i)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = KimiDeltaAttention(cfg, i, dtype) if self.is_kda else MLAttention(cfg, i, dtype)
        if cfg.is_moe(i):
            self.block_sparse_moe = MoE(cfg, dtype)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype)

    def forward(self, x: torch.Tensor, state: StateView, chunk_size: int) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.self_attn(h, state, chunk_size) if self.is_kda else self.self_attn(h, state)
        x = x + h
        ffn = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return x + ffn(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class KimiLinearForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, chunk_size: int = 64):
        super().__init__()
        self.cfg, self.dtype, self.chunk_size = cfg, dtype, chunk_size
        self.model = Backbone(cfg, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.weight = param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def hidden_states(self, tokens: torch.Tensor, state: StateView) -> torch.Tensor:
        x = F.embedding(tokens, self.model.embed_tokens.weight)
        for layer in self.model.layers:
            x = layer(x, state, self.chunk_size)
        return self.model.norm(x)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, state: StateView, last_only: bool = False) -> torch.Tensor:
        """Logits [B, T, vocab] (or [B, vocab] for the last position only), float32."""
        h = self.hidden_states(tokens, state)
        if last_only:
            h = h[:, -1]
        return F.linear(h, self.lm_head_weight).float()

    def checkpoint_map(self) -> dict[str, torch.Tensor]:
        """Official checkpoint tensor name -> the tensor (or view of a fused tensor) it is loaded into."""
        return _views(self, "")


def _views(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    if hasattr(module, "checkpoint_views"):   # fused parameters: the layer maps names to views
        return {prefix + k: v for k, v in module.checkpoint_views().items()}
    out = {prefix + n: p for n, p in module.named_parameters(recurse=False)}
    for name, child in module.named_children():
        out.update(_views(child, f"{prefix}{name}."))
    return out
