"""Kimi / DeepSeek-V3 style MoE: sigmoid router with a selection-only correction bias, routed gated-MLP experts
stored stacked ([E, ...]) and dispatched by expert, plus always-on shared experts.

Latent MoE (Kimi K3): the routed experts run in a narrower width R; a down projection D -> R feeds them and their
weighted sum goes through an RMSNorm and an up projection R -> D. Under tensor parallelism both projections are split
along their inputs and every rank holds a 1/N slice of every expert's intermediate dimension, so the latent input
and the routed sum are each completed by one all-reduce; the caller all-reduces the block's output.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import TP
from ..models.kimi_config import KimiConfig
from ..ops.mxfp4 import BLOCK
from ..ops.mxfp8 import quantize_dequantize_mxfp8
from ..ops.cpu_kernels import MAX_ROWS, kernels
from . import linear as products
from .linear import Int8Weight, linear, linear_mxfp4, weight_parts
from .mlp import GatedMLP, gated_activation, param
from .norm import RMSNorm


def top_k_lowest_index_on_ties(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row ([N, E] fp32), largest first; among equal scores the lower index wins
    (as the reference's iterative argmax), which torch.topk does not promise. A stable descending sort does, and the
    CPU kernel gives its first k without one."""
    cpu = kernels() if scores.device.type == "cpu" and scores.dim() == 2 and scores.dtype == torch.float32 else None
    if cpu is not None:
        return cpu.top_k(scores, k)
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, cfg: KimiConfig
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids and weights per token ([N, k] each), computed in float32."""
    scores = F.linear(x.float(), gate_weight.float()).sigmoid()
    choice = scores + bias.float()
    groups = cfg.num_expert_group
    if groups > 1:   # group-limited routing: keep the topk_group groups with the best top-2 sums
        per_group = choice.view(-1, groups, cfg.num_experts // groups)
        best = per_group.topk(2, dim=-1).values.sum(-1).topk(cfg.topk_group, dim=-1).indices
        keep = torch.zeros_like(per_group[..., 0], dtype=torch.bool).scatter_(1, best, True)
        choice = per_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
    ids = top_k_lowest_index_on_ties(choice, cfg.num_experts_per_token)
    weights = (choice if cfg.router_bias_in_weights else scores).gather(1, ids)
    if cfg.moe_renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


class MoE(nn.Module):
    int8_weights = ("w13", "w2", "routed_expert_down_proj", "routed_expert_up_proj")

    def __init__(self, cfg: KimiConfig, dtype: torch.dtype, tp: TP = TP()):
        super().__init__()
        self.cfg, self.dtype, self.tp = cfg, dtype, tp
        E, D, R = cfg.num_experts, cfg.hidden_size, cfg.expert_width
        self.I = I = cfg.moe_intermediate_size // tp.size
        self.act = gated_activation(cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)
        self.gate_weight = param(E, D, dtype=torch.float32)
        self.e_score_correction_bias = param(E, dtype=torch.float32)
        if cfg.experts_mxfp4:      # packed FP4 codes and E8M0 scales, dequantized per selected expert
            self.w13_packed = param(E, 2 * I, R // 2, dtype=torch.uint8)
            self.w13_scale = param(E, 2 * I, R // BLOCK, dtype=torch.uint8)
            self.w2_packed = param(E, R, I // 2, dtype=torch.uint8)
            self.w2_scale = param(E, R, I // BLOCK, dtype=torch.uint8)
        else:
            self.w13 = param(E, 2 * I, R, dtype=dtype)     # w1 (gate) rows, then w3 (up) rows
            self.w2 = param(E, R, I, dtype=dtype)
        self.latent = cfg.routed_expert_hidden_size is not None
        if self.latent:            # split along their inputs: [R, D/N] and [D, R/N]
            self.routed_expert_down_proj = param(R, D // tp.size, dtype=dtype)
            self.routed_expert_up_proj = param(D, R // tp.size, dtype=dtype)
            self.routed_expert_norm = RMSNorm(R, cfg.rms_norm_eps, dtype) if cfg.latent_moe_norm else None
        shared = cfg.moe_intermediate_size * cfg.num_shared_experts // tp.size
        self.shared_experts = GatedMLP(D, shared, dtype, self.act) if shared else None

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        I = self.I
        views = {"gate.weight": self.gate_weight, "gate.e_score_correction_bias": self.e_score_correction_bias}
        parts = ((("weight_packed", "w13_packed", "w2_packed"), ("weight_scale", "w13_scale", "w2_scale"))
                 if self.cfg.experts_mxfp4 else (("weight", "w13", "w2"),))
        for suffix, w13_name, w2_name in parts:
            w13, w2 = getattr(self, w13_name), getattr(self, w2_name)
            for e in range(self.cfg.num_experts):
                views[f"experts.{e}.w1.{suffix}"] = w13[e, :I]
                views[f"experts.{e}.w3.{suffix}"] = w13[e, I:]
                views[f"experts.{e}.w2.{suffix}"] = w2[e]
        if self.latent:
            views.update({"routed_expert_down_proj.weight": self.routed_expert_down_proj,
                          "routed_expert_up_proj.weight": self.routed_expert_up_proj})
            if self.routed_expert_norm is not None:
                views["routed_expert_norm.weight"] = self.routed_expert_norm.weight
        if self.shared_experts is not None:
            views.update({f"shared_experts.{k}": v for k, v in self.shared_experts.checkpoint_views().items()})
        return views

    def routed_expert_weights(self) -> list[torch.Tensor]:
        """The stacked [E, ...] tensors of the routed experts (a decode step reads the selected rows only)."""
        names = ("w13_packed", "w13_scale", "w2_packed", "w2_scale") if self.cfg.experts_mxfp4 else ("w13", "w2")
        return [getattr(self, n) for n in names]

    def _stacked(self, name: str) -> list[torch.Tensor]:
        """The stacked tensors of one expert projection ("w13" or "w2"): (W), (packed, scales) or (q, scales)."""
        if self.cfg.experts_mxfp4:
            return [getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale")]
        return weight_parts(getattr(self, name))

    def expert(self, e: int, h: torch.Tensor, qdq) -> torch.Tensor:
        """Expert e on the rows h [n, R] -> [n, R] (MXFP4 weights stay packed; see layers/linear.py)."""
        if self.cfg.experts_mxfp4:
            gate, up = linear_mxfp4(h, self.w13_packed[e], self.w13_scale[e]).chunk(2, dim=-1)
            return linear_mxfp4(qdq(self.act(gate, up)), self.w2_packed[e], self.w2_scale[e])
        gate, up = linear(h, self.w13[e]).chunk(2, dim=-1)
        return linear(qdq(self.act(gate, up)), self.w2[e])

    def _cpu_kernels(self, h: torch.Tensor):
        """The CPU kernels where they can run this layer's experts on h (fp32 or bf16 rows on a CPU), else None."""
        return (kernels() if h.device.type == "cpu" and h.dtype in (torch.float32, torch.bfloat16)
                and not self.cfg.expert_input_mxfp8 else None)

    def _decode_kernels(self, h: torch.Tensor):
        """The CPU kernels when they run this step's routed experts (decode: up to 8 tokens), else None."""
        return self._cpu_kernels(h) if h.shape[0] <= MAX_ROWS else None

    def _prefill_kernels(self, h: torch.Tensor):
        """The CPU kernels when they run a prefill chunk's routed experts (dense contiguous weights in h's dtype; int8
        can leave one of w13 and w2 dense), else None."""
        stacks = [getattr(self, name, None) for name in ("w13", "w2")]
        dense = all(isinstance(w, torch.Tensor) and w.dtype == h.dtype and w.is_contiguous() for w in stacks)
        return self._cpu_kernels(h) if dense else None

    @property
    def fuses_shared(self) -> bool:
        """Whether the decode kernel runs the shared expert beside the routed ones: it reads the routed experts'
        input (no latent MoE) and has their widths."""
        s = self.shared_experts
        return s is not None and not self.latent and s.intermediate == self.I

    def experts(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_k weights[n, k] * expert_{ids[n, k]}(h[n]) for every token n; h [N, R] -> [N, R]. Experts run in
        ascending order, as the reference sums them; assignments are grouped by one sort (one host sync). On a CPU the
        same loop runs as one kernel call: decode's (up to 8 tokens), and a prefill chunk's with dense experts."""
        qdq = quantize_dequantize_mxfp8 if self.cfg.expert_input_mxfp8 else (lambda t: t)
        h = qdq(h)
        N, k = ids.shape
        fused = self._decode_kernels(h)
        if fused is not None:
            return fused.routed_experts(h, ids, weights, self._stacked("w13"), self._stacked("w2"),
                                        self.cfg.hidden_act == "situ", self.cfg.situ_beta, self.cfg.situ_linear_beta,
                                        [], [])[0]
        if N <= MAX_ROWS and self.gathers_experts:
            return self.experts_gathered(h, ids, weights)
        prefill = self._prefill_kernels(h)
        if prefill is not None:                     # the loop below as one CPU kernel call, bit for bit
            widen = None if products.CPU_BF16_ARITHMETIC else products.WIDEN_FROM_ROWS
            return prefill.routed_experts_prefill(h, ids, weights, self.w13, self.w2, self.cfg.hidden_act == "situ",
                                                  self.cfg.situ_beta, self.cfg.situ_linear_beta, widen)
        # assignments (n * k + j) in expert order, then slot order: each expert's rows are one slice of a single gather
        order = ids.flatten().argsort(stable=True)
        counts = torch.bincount(ids.flatten(), minlength=self.cfg.num_experts).tolist()      # the one host sync
        rows, row_weights = h[order // k], weights.flatten()[order, None]
        results = torch.empty_like(rows)
        begin = 0
        for e, n in enumerate(counts):
            if n:
                end = begin + n
                results[begin:end] = self.expert(e, rows[begin:end], qdq) * row_weights[begin:end]
                begin = end
        del rows
        # each token's results added in h's dtype in ascending expert order, one expert at a time, as adding each
        # expert's results in turn (index_add_) rounds them; a token's experts are distinct (route), so the order is
        # unique. at[n, i]: the row of results holding token n's i-th smallest expert.
        at = order.argsort().view(N, k).gather(1, ids.argsort(dim=1))
        out = torch.zeros_like(h)
        for i in range(k):
            out = out + results[at[:, i]]
        return out

    @property
    def gathers_experts(self) -> bool:
        """Whether a decode step's experts run through `experts_gathered` (dense weights off the CPU)."""
        w13 = getattr(self, "w13", None)
        return isinstance(w13, torch.Tensor) and w13.device.type != "cpu" and not self.cfg.expert_input_mxfp8

    def experts_gathered(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`experts` for a few tokens with no host sync and shapes fixed by [N, k] (what a CUDA graph needs): each
        (token, expert) pair's weights gathered and applied as one batched product, summed per token in ascending
        expert order like the loop."""
        N, k = ids.shape
        order = ids.argsort(dim=1)
        ids, weights = ids.gather(1, order).flatten(), weights.gather(1, order).flatten()
        x = h.repeat_interleave(k, dim=0).unsqueeze(-1)                              # [N k, R, 1]
        gate, up = torch.bmm(self.w13[ids], x).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.w2[ids], self.act(gate, up).unsqueeze(-1)).squeeze(-1) * weights[:, None]
        y = y.to(h.dtype).view(N, k, -1)
        out = torch.zeros_like(h)
        for j in range(k):
            out = out + y[:, j]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, weights = route(x, self.gate_weight, self.e_score_correction_bias, self.cfg)
        fused = self._decode_kernels(x) if self.fuses_shared else None
        if fused is not None:      # routed and shared experts in one kernel call: two passes over the weights
            out, shared = fused.routed_experts(x, ids, weights, self._stacked("w13"), self._stacked("w2"),
                                               self.cfg.hidden_act == "situ", self.cfg.situ_beta,
                                               self.cfg.situ_linear_beta, weight_parts(self.shared_experts.gate_up),
                                               weight_parts(self.shared_experts.down))
            return (out + shared).view(shape)
        if not self.latent:
            out = self.experts(x, ids, weights)
        else:
            D, R = self.cfg.hidden_size, self.cfg.expert_width
            h = self.tp.all_reduce(linear(x[:, self.tp.share(D)], self.routed_expert_down_proj))
            routed = self.tp.all_reduce(self.experts(h, ids, weights))
            if self.routed_expert_norm is not None:
                routed = self.routed_expert_norm(routed)
            out = linear(routed[:, self.tp.share(R)], self.routed_expert_up_proj)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)
