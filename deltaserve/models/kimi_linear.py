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
from ..parallel import TP
from ..state import StateView


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, dtype: torch.dtype, tp: TP):
        super().__init__()
        self.is_kda, self.tp = cfg.is_kda(i), tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if self.is_kda:
            self.self_attn = KimiDeltaAttention(cfg, i, dtype, cfg.kda_num_heads // tp.size)
        else:
            self.self_attn = MLAttention(cfg, i, dtype, cfg.num_attention_heads // tp.size)
        if cfg.is_moe(i):
            self.block_sparse_moe = MoE(cfg, dtype, tp.size)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size // tp.size, dtype)

    def forward(self, x: torch.Tensor, state: StateView, chunk_size: int) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.self_attn(h, state, chunk_size) if self.is_kda else self.self_attn(h, state)
        x = x + self.tp.all_reduce(h)                # o_proj is row-parallel: sum the ranks' partial outputs
        ffn = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return x + self.tp.all_reduce(ffn(self.post_attention_layernorm(x)))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: TP):
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = param(cfg.vocab_size // tp.size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class KimiLinearForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, chunk_size: int = 64, tp: TP = TP()):
        """With tp.size > 1 this process holds its rank's slice of the model (see parallel.py)."""
        super().__init__()
        self.cfg, self.dtype, self.chunk_size, self.tp = cfg, dtype, chunk_size, tp
        self.kda_heads_local = cfg.kda_num_heads // tp.size
        self.model = Backbone(cfg, dtype, tp)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.weight = param(cfg.vocab_size // tp.size, cfg.hidden_size, dtype=dtype)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight
        if self.tp.size == 1:
            return F.embedding(tokens, weight)
        local = tokens - self.tp.rank * weight.shape[0]          # vocab-parallel: rows this rank holds
        mine = (local >= 0) & (local < weight.shape[0])
        x = F.embedding(local.clamp(0, weight.shape[0] - 1), weight) * mine.unsqueeze(-1).to(weight.dtype)
        return self.tp.all_reduce(x)

    def hidden_states(self, tokens: torch.Tensor, state: StateView) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.model.layers:
            x = layer(x, state, self.chunk_size)
        return self.model.norm(x)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, state: StateView, last_only: bool = False) -> torch.Tensor:
        """Logits [B, T, vocab] (or [B, vocab] for the last position only), float32, on every rank."""
        h = self.hidden_states(tokens, state)
        if last_only:
            h = h[:, -1]
        return self.tp.all_gather_last(F.linear(h, self.lm_head_weight).float())

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
