"""Kimi Delta Attention: projections, causal short conv with a carried window, per-channel forget gate,
delta-rule recurrence (chunked for prompts, recurrent for single tokens), gated head-wise RMSNorm."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..ops.delta_rule import delta_rule_chunked, delta_rule_recurrent, l2norm
from ..state import StateView
from .mlp import param
from .norm import gated_rms_norm


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, num_heads: int | None = None):
        super().__init__()
        self.layer, self.eps = layer, cfg.rms_norm_eps
        self.H = num_heads or cfg.kda_num_heads
        self.K = cfg.kda_head_dim
        self.W = cfg.conv_kernel_size
        D, P, K = cfg.hidden_size, self.H * cfg.kda_head_dim, cfg.kda_head_dim
        self.P = P
        # One matmul for everything read from x: q | k | v | f_a | g_a | b.
        self.split = [3 * P, K, K, self.H]
        self.in_proj = param(sum(self.split), D, dtype=dtype)
        self.conv = param(3 * P, 1, self.W, dtype=dtype)       # depthwise q | k | v taps
        self.gate_up = param(2, P, K, dtype=dtype)             # f_b and g_b, applied as one batched matmul
        self.dt_bias = param(P, dtype=torch.float32)
        self.A_log = param(1, 1, self.H, 1, dtype=torch.float32)
        self.o_norm = param(K, dtype=dtype)
        self.o_proj = param(D, P, dtype=dtype)

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        P, K, H = self.P, self.K, self.H
        w, c = self.in_proj, self.conv
        return {
            "q_proj.weight": w[:P], "k_proj.weight": w[P:2 * P], "v_proj.weight": w[2 * P:3 * P],
            "f_a_proj.weight": w[3 * P:3 * P + K], "g_a_proj.weight": w[3 * P + K:3 * P + 2 * K],
            "b_proj.weight": w[3 * P + 2 * K:3 * P + 2 * K + H],
            "q_conv1d.weight": c[:P], "k_conv1d.weight": c[P:2 * P], "v_conv1d.weight": c[2 * P:],
            "f_b_proj.weight": self.gate_up[0], "g_b_proj.weight": self.gate_up[1],
            "dt_bias": self.dt_bias, "A_log": self.A_log, "o_norm.weight": self.o_norm, "o_proj.weight": self.o_proj,
        }

    def forward(self, x: torch.Tensor, state: StateView, chunk_size: int) -> torch.Tensor:
        B, T, _ = x.shape
        H, K = self.H, self.K
        qkv, f_a, g_a, b = F.linear(x, self.in_proj).split(self.split, dim=-1)
        conv_window, recurrent = state.kda(self.layer)
        # Causal depthwise conv over [carried W-1 inputs | new inputs], accumulated in float32.
        window = torch.cat((conv_window, qkv), dim=1)
        taps = self.conv.squeeze(1).float()
        conv = sum(window[:, j:j + T].float() * taps[:, j] for j in range(self.W))
        q, k, v = F.silu(conv).to(x.dtype).view(B, T, 3, H, K).unbind(2)
        q, k = l2norm(q.float()), l2norm(k.float())
        f, z = torch.bmm(torch.stack((f_a, g_a)).view(2, B * T, K), self.gate_up.transpose(1, 2)).view(2, B, T, H, K)
        # Forget gate in log space: g = -exp(A_log) * softplus(f + dt_bias) <= 0, per head and key channel.
        g = -self.A_log.float().view(H, 1).exp() * F.softplus(f.float() + self.dt_bias.view(H, K), threshold=20.0)
        beta = torch.sigmoid(b.float())
        if T == 1:      # in place on the slot's state
            o, recurrent = delta_rule_recurrent(q, k, v.float(), g, beta, recurrent, K ** -0.5)
        else:
            o, recurrent = delta_rule_chunked(q, k, v.float(), g, beta, recurrent, K ** -0.5, chunk_size)
        state.set_kda(self.layer, window[:, -(self.W - 1):], recurrent)
        o = gated_rms_norm(o, z, self.o_norm, self.eps).to(x.dtype)
        return F.linear(o.reshape(B, T, H * K), self.o_proj)
