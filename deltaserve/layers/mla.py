"""Multi-head latent attention without positional encoding (Kimi Linear's full-attention layers).

The cache holds only the normalised compressed latent c_kv and the shared k_pe per token. Attention runs in
the absorbed form: W_UK is folded into the query and W_UV applied after attention, so keys and values are
never expanded per head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import TP
from ..models.kimi_config import KimiConfig
from ..models.spec import StateSpec
from ..ops.cpu_kernels import fused_decode, kernels
from ..state import StateView
from .linear import linear, matmul, product_dtype
from .mlp import param
from .norm import RMSNorm


class MLAttention(nn.Module):
    int8_weights = ("in_proj", "q_b_proj", "o_proj")          # kv_b_proj is absorbed into the attention products

    def __init__(self, cfg: KimiConfig, layer: int, dtype: torch.dtype, tp: TP = TP()):
        super().__init__()
        self.layer, self.dtype = layer, dtype
        self.H = cfg.num_attention_heads // tp.size        # heads held by this rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank, self.q_rank = cfg.kv_lora_rank, cfg.q_lora_rank
        self.scale = cfg.qk_head_dim ** -0.5
        D, q_out = cfg.hidden_size, self.H * cfg.qk_head_dim
        # One matmul for what is read from x: q (or its low-rank down projection) | c_kv | k_pe | output gate.
        self.q_width = self.q_rank or q_out
        self.gate_width = self.H * self.v_dim if cfg.mla_output_gate else 0
        self.in_proj = param(self.q_width + self.rank + self.rope + self.gate_width, D, dtype=dtype)
        if self.q_rank:
            self.q_a_layernorm = RMSNorm(self.q_rank, 1e-6, dtype)
            self.q_b_proj = param(q_out, self.q_rank, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6, dtype)   # eps 1e-6 as the HF code (vLLM uses 1e-5)
        self.kv_b_proj = param(self.H * (self.nope + self.v_dim), self.rank, dtype=dtype)
        self.o_proj = param(D, self.H * self.v_dim, dtype=dtype)

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        q, kv, gate = self.in_proj.split([self.q_width, self.rank + self.rope, self.gate_width])
        views = {"kv_a_proj_with_mqa.weight": kv, "kv_a_layernorm.weight": self.kv_a_layernorm.weight,
                 "kv_b_proj.weight": self.kv_b_proj, "o_proj.weight": self.o_proj}
        if self.gate_width:
            views["g_proj.weight"] = gate
        if self.q_rank:
            views.update({"q_a_proj.weight": q, "q_a_layernorm.weight": self.q_a_layernorm.weight,
                          "q_b_proj.weight": self.q_b_proj})
        else:
            views["q_proj.weight"] = q
        return views

    def state_spec(self) -> dict[str, StateSpec]:
        # in the activation dtype, whose values it holds either way: on a CPU without bf16 arithmetic the products
        # widen it as they read it, and a bf16 cache is half the memory and half the bytes a decode step streams
        return {"latent": StateSpec((self.rank + self.rope,), self.dtype, per_token=True)}   # c_kv | k_pe

    def finalize(self) -> None:
        """After loading: the absorption matrices, split per head and laid out contiguously for matmul."""
        w_kv = self.kv_b_proj.view(self.H, self.nope + self.v_dim, self.rank)
        dtype = product_dtype(self.dtype, self.kv_b_proj.device)
        self.w_uk = w_kv[:, :self.nope].to(dtype).contiguous()                              # [H, nope, r]
        self.w_uv_t = w_kv[:, self.nope:].transpose(1, 2).to(dtype).contiguous()            # [H, r, v]
        self.fused_step = kernels() if fused_decode(self.kv_b_proj) else None     # decode attention as one op
        if self.fused_step is not None:       # the kernel's layout: each head's rows, in the weights' own dtype
            self.w_uk_rows = w_kv[:, :self.nope].transpose(1, 2).contiguous()               # [H, r, nope]
            self.w_uv_rows = w_kv[:, self.nope:]                                             # [H, v, r], a view

    def forward(self, x: torch.Tensor, state: StateView) -> torch.Tensor:
        B, T, _ = x.shape
        H = self.H
        q, c, k_pe, gate = linear(x, self.in_proj).split([self.q_width, self.rank, self.rope, self.gate_width], -1)
        if self.q_rank:
            q = linear(self.q_a_layernorm(q), self.q_b_proj)
        latent = torch.cat((self.kv_a_layernorm(c), k_pe), dim=-1)
        if T == 1 and self.fused_step is not None:     # absorption and attention in one op, in place on the pool
            out = self.fused_step.mla_decode(q.view(B, H, self.nope + self.rope), self.w_uk_rows, self.w_uv_rows,
                                             state.pool_tensor(self.layer, "latent"), latent[:, 0].contiguous(),
                                             state.slot_ids, state.positions, self.scale).unsqueeze(1)
        else:
            q = q.view(B, T, H, self.nope + self.rope).transpose(1, 2)            # [B, H, T, 192]
            query = torch.cat((matmul(q[..., :self.nope], self.w_uk), q[..., self.nope:]), dim=-1)    # [.., r + rope]
            cache = state.append(self.layer, "latent", latent)                 # [B, L, r + rope]
            ctx = latent_attention(query, cache, state.query_positions(T), self.scale, self.rank)    # [B, H, T, r]
            out = matmul(ctx, self.w_uv_t).transpose(1, 2).reshape(B, T, H * self.v_dim)
        if self.gate_width:
            out = out * torch.sigmoid(gate)
        return linear(out, self.o_proj)


# The most attention scores `latent_attention` holds at once (with the softmax's copies, 8-12 bytes each).
SCORES_PER_BLOCK = 1 << 26


def latent_attention(query: torch.Tensor, cache: torch.Tensor, query_pos: torch.Tensor, scale: float, rank: int
                     ) -> torch.Tensor:
    """softmax(q c^T * scale) c[:, :rank], the query at position query_pos[b, t] over the keys at positions <= it,
    with one latent key row shared by all heads (MQA): heads are folded into query rows, so the cache is read once
    per block of queries and never expanded per head. Queries go SCORES_PER_BLOCK scores at a time: a 512-token
    prefill chunk of 32 heads over 128K positions would otherwise hold 2G scores (16-25 GB with the softmax's
    copies). Each query's softmax is its own; only the matrix products see the blocks (a small block can take
    another kernel, rounded differently)."""
    B, H, T, C = query.shape
    positions = torch.arange(cache.shape[1], device=cache.device)
    step = max(1, SCORES_PER_BLOCK // (B * H * cache.shape[1]))
    # in blocks, the keys transposed once: each block's product would transpose them again (bench: 32 heads,
    # 32K positions, 16 blocks of a chunk: 5.3 -> 4.2 s)
    keys = cache.transpose(1, 2) if step >= T else cache.transpose(1, 2).contiguous()
    blocks = [_attend(query[:, :, s:s + step], keys, cache[..., :rank], positions <= query_pos[:, s:s + step, None],
                      scale) for s in range(0, T, step)]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float
            ) -> torch.Tensor:
    B, H, T, C = query.shape
    scores = matmul(query.reshape(B, H * T, C), keys).view(B, H, T, -1) * scale
    probs = scores.masked_fill_(~visible[:, None], float("-inf")).softmax(-1, dtype=torch.float32).to(query.dtype)
    return matmul(probs.view(B, H * T, -1), values).view(B, H, T, -1)
