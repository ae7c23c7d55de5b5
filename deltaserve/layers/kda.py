"""Kimi Delta Attention: gated delta rule with a fine-grained (per key channel) forget gate, short convolutions
on q/k/v, and a gated RMSNorm on the output.

Family variants, each a config field: the output gate is low-rank (g_a_proj, g_b_proj: Kimi Linear) or full-rank
(g_proj: K3) and goes through sigmoid (published) or SiLU (the seed's K3); the forget gate is
-exp(A) softplus(f + dt_bias) or, with a lower bound L, L sigmoid(exp(A) (f + dt_bias)) (K3); A_log is per head
(stored [1, 1, H, 1], or padded to head_dim in K3) or, as the seed reads K3's, per key channel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import TP
from ..models.kimi_config import KimiConfig
from ..models.spec import StateSpec
from ..ops.delta_rule import chunked_kda, l2norm
from ..ops.cpu_kernels import fused_decode, kernels
from ..ops.kda import cpu_chunk_prepare, kda_kernels
from ..state import StateView
from .linear import linear, weight_parts
from .mlp import param
from .norm import gated_rms_norm


def forget_gate(f: torch.Tensor, a: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Log-decay (<= 0) from the gate input f = f_b(f_a(x)) + dt_bias and a = exp(A_log): -a softplus(f), or with a
    lower bound L, L sigmoid(a f), which keeps every decay above e^L."""
    if lower_bound:
        return lower_bound * torch.sigmoid(a * f)
    return -a * F.softplus(f, threshold=20.0)


class KimiDeltaAttention(nn.Module):
    int8_weights = ("in_proj", "f_b", "g_b", "o_proj")

    def __init__(self, cfg: KimiConfig, layer: int, dtype: torch.dtype, tp: TP = TP(), chunk_size: int = 64):
        super().__init__()
        self.layer, self.eps, self.chunk_size, self.dtype = layer, cfg.rms_norm_eps, chunk_size, dtype
        self.H = cfg.kda_num_heads // tp.size               # heads held by this rank
        self.K = K = cfg.kda_head_dim
        self.W = cfg.conv_kernel_size
        self.full_rank_gate, self.bound = cfg.kda_full_rank_gate, cfg.kda_gate_lower_bound
        self.gate_activation = cfg.kda_output_gate_activation
        D, P = cfg.hidden_size, self.H * K
        self.P = P
        # One matmul for everything read from x: q | k | v | f_a | g (full-rank, P) or g_a (K) | b.
        self.split = [3 * P, K, P if self.full_rank_gate else K, self.H]
        self.in_proj = param(sum(self.split), D, dtype=dtype)
        self.conv = param(3 * P, 1, self.W, dtype=dtype)       # depthwise q | k | v taps
        self.f_b = param(P, K, dtype=dtype)
        if not self.full_rank_gate:
            self.g_b = param(P, K, dtype=dtype)
        self.dt_bias = param(P, dtype=torch.float32)
        # As stored: one value per head ([1, 1, H, 1], split across ranks), or head_dim values replicated (K3).
        self.A_log = param(K, dtype=torch.float32) if cfg.kda_a_log_padded else param(1, 1, self.H, 1,
                                                                                         dtype=torch.float32)
        self.per_channel = cfg.kda_a_log_layout == "per_channel"
        self.heads = tp.share(cfg.kda_num_heads) if cfg.kda_a_log_padded else slice(None)   # this rank's A_log
        self.o_norm = param(K, dtype=dtype)
        self.o_proj = param(D, P, dtype=dtype)

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        P, K = self.P, self.K
        q, k, v, f_a, g, b = self.in_proj.split([P, P, P, K, self.split[2], self.H])
        c = self.conv
        views = {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v, "f_a_proj.weight": f_a,
                 "b_proj.weight": b, "q_conv1d.weight": c[:P], "k_conv1d.weight": c[P:2 * P],
                 "v_conv1d.weight": c[2 * P:], "f_b_proj.weight": self.f_b, "dt_bias": self.dt_bias,
                 "A_log": self.A_log, "o_norm.weight": self.o_norm, "o_proj.weight": self.o_proj}
        if self.full_rank_gate:
            views["g_proj.weight"] = g
        else:
            views.update({"g_a_proj.weight": g, "g_b_proj.weight": self.g_b})
        return views

    def state_spec(self) -> dict[str, StateSpec]:
        return {"conv": StateSpec((self.W - 1, 3 * self.P), self.dtype),       # pre-conv q | k | v inputs
                "recurrent": StateSpec((self.H, self.K, self.K), torch.float32)}

    def finalize(self) -> None:
        """After loading: exp(A_log) as it scales the gate input ([H, 1] per head or [K] per key channel), the conv
        taps as float32 depthwise filters, and the KDA kernels for this device."""
        a = self.A_log.float().flatten()
        self.decay_rate = a.exp() if self.per_channel else a[self.heads].exp().view(self.H, 1)
        self.taps = self.conv.float()
        self.chunk_kernel, self.recurrent_kernel = kda_kernels(self.conv.device.type, self.chunk_size)
        # the CPU kernels: the decode step as one op, and a prefill's chunked inputs
        self.fused_step = kernels() if fused_decode(self.conv) else None
        self.taps_by_tap = self.taps.squeeze(1).t().contiguous()           # [W, 3P]: the CPU kernels' layout
        self.o_norm_f32 = self.o_norm.float()             # the decode kernel's (not converted at every step)

    def forward(self, x: torch.Tensor, state: StateView) -> torch.Tensor:
        B, T, _ = x.shape
        if T == 1 and self.fused_step is not None:
            return self.decode_fused(x, state)
        H, K = self.H, self.K
        qkv, f_a, g, b = linear(x, self.in_proj).split([3 * self.P, K, self.split[2], H], dim=-1)
        # Causal depthwise conv over [carried W-1 inputs | new inputs], accumulated in float32.
        window = torch.cat((state.get(self.layer, "conv"), qkv), dim=1)
        f = linear(f_a, self.f_b)
        z = (g if self.full_rank_gate else linear(g, self.g_b)).view(B, T, H, K)
        if T > 1 and self.fused_step is not None and K % 16 == 0:      # the chunks' inputs from one CPU kernel
            chunks = self.fused_step.kda_chunk_inputs(window, self.taps_by_tap, f, self.dt_bias, self.decay_rate,
                                                      self.bound or 0.0, self.per_channel, b, K ** -0.5,
                                                      self.chunk_size)
            o, recurrent = chunked_kda(*chunks, T, state.get(self.layer, "recurrent"), cpu_chunk_prepare)
        else:
            conv = F.conv1d(window.transpose(1, 2).float(), self.taps, groups=3 * self.P).transpose(1, 2)
            qkv = F.silu(conv).to(x.dtype).view(B, T, 3, H, K)
            qk, v = l2norm(qkv[:, :, :2].float()), qkv[:, :, 2].float()
            log_decay = forget_gate(f.float().view(B, T, H, K) + self.dt_bias.view(H, K), self.decay_rate, self.bound)
            kernel = self.recurrent_kernel if T == 1 else self.chunk_kernel  # recurrent: in place on the slot's state
            o, recurrent = kernel(qk[:, :, 0], qk[:, :, 1], v, log_decay, torch.sigmoid(b.float()), K ** -0.5,
                                  state.get(self.layer, "recurrent"))
        state.put(self.layer, "conv", window[:, -(self.W - 1):])
        state.put(self.layer, "recurrent", recurrent)
        o = gated_rms_norm(o, z, self.o_norm, self.eps, self.gate_activation).to(x.dtype)
        return linear(o.reshape(B, T, H * K), self.o_proj)

    def decode_fused(self, x: torch.Tensor, state: StateView) -> torch.Tensor:
        """The T = 1 path of `forward` with everything between the input and output projections in one CPU kernel,
        the gates' low-rank up projections included (same math and roundings; see csrc/cpu_gemv.cpp), in place on
        the pool's slots."""
        qkv, f_a, g, b = linear(x[:, 0], self.in_proj).split([3 * self.P, self.K, self.split[2], self.H], dim=-1)
        g_b = [] if self.full_rank_gate else weight_parts(self.g_b)
        o = self.fused_step.kda_decode_step(qkv, state.pool_tensor(self.layer, "conv"), self.taps_by_tap, f_a,
                                            weight_parts(self.f_b), self.dt_bias, self.decay_rate, self.bound or 0.0, b,
                                            g, g_b, self.o_norm_f32, self.eps, self.gate_activation == "silu",
                                            self.per_channel, state.pool_tensor(self.layer, "recurrent"),
                                            state.slot_ids)
        return linear(o, self.o_proj).unsqueeze(1)
