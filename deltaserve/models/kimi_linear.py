"""The Kimi Linear family (Kimi Linear, Kimi K3): KDA and NoPE-MLA token mixers, dense and MoE channel mixers,
a plain or a Block-Attention-Residual stream, assembled from the config's fields.

`forward(tokens, state)` appends `tokens` ([B, T]) to the sequences in `state` and returns next-token logits.
Module attribute names follow the official checkpoint, so the checkpoint map is mostly the parameter names.
"""
from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import TP
from ..layers.kda import KimiDeltaAttention
from ..layers.linear import Int8Weight, linear
from ..layers.mla import MLAttention
from ..layers.mlp import GatedMLP, Weight, gated_activation
from ..layers.moe import MoE
from ..layers.norm import RMSNorm
from ..layers.residual import depth_mix, mix_params
from ..state import StateView
from .kimi_config import KimiConfig, parse_kimi
from .spec import ModelSpec, SplitPlan, StateSpec


class DecoderLayer(nn.Module):
    def __init__(self, cfg: KimiConfig, i: int, dtype: torch.dtype, tp: TP, chunk_size: int):
        super().__init__()
        self.tp = tp
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.self_attn = (KimiDeltaAttention(cfg, i, dtype, tp, chunk_size) if cfg.is_kda(i)
                          else MLAttention(cfg, i, dtype, tp))
        if cfg.is_moe(i):
            self.block_sparse_moe = MoE(cfg, dtype, tp)
        else:
            act = gated_activation(cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size // tp.size, dtype, act)
        self.attn_res = cfg.attn_res_block_size > 0
        if self.attn_res:
            self.starts_block = i % cfg.attn_res_block_size == 0
            self.self_attention_res_norm, self.self_attention_res_proj = mix_params(cfg.hidden_size, eps, dtype)
            self.mlp_res_norm, self.mlp_res_proj = mix_params(cfg.hidden_size, eps, dtype)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def mixer(self, x: torch.Tensor, state: StateView) -> torch.Tensor:
        # output projections are row-parallel: sum the ranks' partial outputs
        return self.tp.all_reduce(self.self_attn(self.input_layernorm(x), state))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.ffn(self.post_attention_layernorm(x)))

    def forward(self, x: torch.Tensor, blocks: list[torch.Tensor], state: StateView
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """x: the residual stream, or with attention residuals the partial sum of the current block's sub-layer
        outputs; blocks: the archived block sums (embedding first)."""
        if not self.attn_res:
            x = x + self.mixer(x, state)
            return x + self.feed_forward(x), blocks
        attn_in = depth_mix(blocks + [x], self.self_attention_res_norm, self.self_attention_res_proj) if blocks else x
        if self.starts_block:                        # archive the finished block, start a new partial sum
            blocks = blocks + [x]
            partial = self.mixer(attn_in, state)
        else:
            partial = x + self.mixer(attn_in, state)
        ffn_in = depth_mix(blocks + [partial], self.mlp_res_norm, self.mlp_res_proj)
        return partial + self.feed_forward(ffn_in), blocks


class Backbone(nn.Module):
    def __init__(self, cfg: KimiConfig, dtype: torch.dtype, tp: TP, chunk_size: int):
        super().__init__()
        self.embed_tokens = Weight(cfg.vocab_size // tp.size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, tp, chunk_size) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.attn_res_block_size:
            self.output_attn_res_norm, self.output_attn_res_proj = mix_params(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class KimiLinearForCausalLM(nn.Module):
    def __init__(self, cfg: KimiConfig, dtype: torch.dtype = torch.float32, chunk_size: int = 64, tp: TP = TP()):
        """With tp.size > 1 this process holds its rank's slice of the model (see models/spec.py SplitPlan)."""
        super().__init__()
        self.cfg, self.dtype, self.chunk_size, self.tp = cfg, dtype, chunk_size, tp
        self.model = Backbone(cfg, dtype, tp, chunk_size)
        if not cfg.tie_word_embeddings:
            self.lm_head = Weight(cfg.vocab_size // tp.size, cfg.hidden_size, dtype=dtype, int8=True)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def state_spec(self) -> dict[int, dict[str, StateSpec]]:
        return {i: layer.self_attn.state_spec() for i, layer in enumerate(self.model.layers)}

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight
        if self.tp.size == 1:
            return F.embedding(tokens, weight)
        local = tokens - self.tp.rank * weight.shape[0]          # vocab-parallel: rows this rank holds
        mine = (local >= 0) & (local < weight.shape[0])
        x = F.embedding(local.clamp(0, weight.shape[0] - 1), weight) * mine.unsqueeze(-1).to(weight.dtype)
        return self.tp.all_reduce(x)

    def hidden_states(self, tokens: torch.Tensor, state: StateView) -> torch.Tensor:
        x, blocks = self.embed(tokens), []
        for layer in self.model.layers:
            x, blocks = layer(x, blocks, state)
        if blocks:
            x = depth_mix(blocks + [x], self.model.output_attn_res_norm, self.model.output_attn_res_proj)
        return self.model.norm(x)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, state: StateView, last_only: bool = False) -> torch.Tensor:
        """Logits [B, T, vocab] (or [B, vocab] for the last position only), float32, on every rank."""
        h = self.hidden_states(tokens, state)
        last = linear(h[:, -1], self.lm_head_weight, float_out=True)
        if last_only:
            return self.tp.all_gather_last(last)
        logits = linear(h, self.lm_head_weight, float_out=True)
        logits[:, -1] = last        # as a decode step computes it: the same whether or not the others are asked for
        return self.tp.all_gather_last(logits)

    def checkpoint_map(self) -> dict[str, torch.Tensor]:
        """Official checkpoint tensor name -> the tensor (or view of a fused tensor) it is loaded into."""
        return _views(self, "")

    def weight_bytes_per_step(self, batch: int = 1) -> float:
        """Weight bytes one decode step of `batch` sequences reads on this rank (the roofline of a memory-bound
        decode): every weight but the embedding's other rows and, of the routed experts, the share that uniform
        top-k routing of `batch` tokens selects on average, 1 - (1 - k/E)^batch (k/E for one token)."""
        cfg = self.cfg
        routed = {id(w) for m in self.modules() if isinstance(m, MoE) for w in m.routed_expert_weights()}
        routed_share = 1 - (1 - cfg.num_experts_per_token / cfg.num_experts) ** batch if cfg.num_experts else 0.0
        total = 0.0
        for module in self.modules():
            for w in [*module._parameters.values(), *(v for v in vars(module).values() if isinstance(v, Int8Weight))]:
                n = w.nbytes if isinstance(w, Int8Weight) else w.numel() * w.element_size()
                if w is self.model.embed_tokens.weight and not cfg.tie_word_embeddings:
                    n = n * min(batch, w.shape[0]) / w.shape[0]
                elif id(w) in routed:
                    n = n * routed_share
                total += n
        return total


def _views(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    if hasattr(module, "checkpoint_views"):   # fused parameters: the layer maps names to views
        return {prefix + k: v for k, v in module.checkpoint_views().items()}
    out = {prefix + n: p for n, p in module.named_parameters(recurse=False)}
    for name, child in module.named_children():
        out.update(_views(child, f"{prefix}{name}."))
    return out


def split_plan(cfg: KimiConfig) -> SplitPlan:
    """Megatron style, by checkpoint name: KDA q/k/v, their conv taps, f_b, the output gate (g_b or full-rank g),
    dt_bias, beta and (one value per head) A_log split by head; MLA q (or q_b), kv_b and its output gate split by
    head; routed experts, shared experts and dense MLPs along their intermediate dimension (gate/up rows, down
    columns); the latent MoE projections along their inputs; embedding and LM head by vocabulary. Every output
    projection (o_proj, down, latent up) is row-parallel, so one all-reduce follows each mixer and each FFN.
    The low-rank down projections (f_a, g_a, kv_a, q_a), their norms, the router, K3's padded A_log and all
    RMSNorms are replicated."""
    rules = [
        (r"self_attn\.[qkv]_proj\.weight$", 0),
        (r"self_attn\.[qkv]_conv1d\.weight$", 0),
        (r"self_attn\.(f_b|g_b|g)_proj\.weight$", 0),
        (r"self_attn\.b_proj\.weight$", 0),
        (r"self_attn\.dt_bias$", 0),
        (r"self_attn\.q_b_proj\.weight$", 0),
        (r"self_attn\.kv_b_proj\.weight$", 0),
        (r"self_attn\.o_proj\.weight$", 1),
        (r"(mlp|shared_experts)\.(gate|up)_proj\.weight$", 0),
        (r"(mlp|shared_experts)\.down_proj\.weight$", 1),
        (r"experts\.\d+\.w[13]\.weight(_packed|_scale)?$", 0),
        (r"experts\.\d+\.w2\.weight(_packed|_scale)?$", 1),
        (r"routed_expert_(down|up)_proj\.weight$", 1),
        (r"(embed_tokens|lm_head)\.weight$", 0),
    ]
    if not cfg.kda_a_log_padded:
        rules.append((r"self_attn\.A_log$", 2))           # stored [1, 1, H, 1]
    return SplitPlan(tuple(rules))


ROLES = (
    ("routed_experts", r"\.experts\.\d+\."),
    ("shared_experts", r"\.shared_experts\."),
    ("latent_moe", r"\.routed_expert_"),
    ("router", r"\.block_sparse_moe\.gate\."),
    ("dense_mlp", r"\.mlp\."),
    ("embeddings", r"(embed_tokens|lm_head)\.weight$"),
    ("attention_residuals", r"_res_(norm|proj)\.weight$"),
    ("norms", r"(layernorm|norm)\.weight$"),
)


def tensor_role(name: str, cfg: KimiConfig) -> str:
    for label, pattern in ROLES:
        if re.search(pattern, name):
            return label
    layer = re.search(r"layers\.(\d+)\.self_attn\.", name)
    if layer:
        return "kda" if cfg.is_kda(int(layer.group(1))) else "mla"
    return "other"


def random_weight(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """make-tiny: weights scaled so activations stay O(1) through every layer, making parity tests sensitive."""
    import math
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


def parse_config(raw: dict[str, Any], overrides: dict[str, Any] | None = None) -> KimiConfig:
    return parse_kimi({**raw, **(overrides or {})})


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
    "bos_token_id": 480,        # [BOS]: the special-token block starts after 256 bytes + 224 merges
    "eos_token_id": 482,        # <|im_end|>
    "pad_token_id": 511,        # [PAD]
    "model_max_length": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "initializer_range": 0.02,
    "use_cache": True,
    "dtype": "bfloat16",
}
# make-tiny presets: "tiny" for tests, "bench" a model big enough for meaningful CPU timings
# (hidden 1024, 12 layers of which 3 MLA, 32 experts of 512, Kimi's 163,840-token vocabulary).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": TINY_CONFIG,
    "bench": {**TINY_CONFIG, **dict(
        vocab_size=163840, hidden_size=1024, intermediate_size=4096, moe_intermediate_size=512, num_hidden_layers=12,
        num_attention_heads=8, num_key_value_heads=8, head_dim=128, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, num_experts=32, num_experts_per_token=4,
        linear_attn_config={"full_attn_layers": [4, 8, 12], "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11],
                            "head_dim": 128, "num_heads": 8, "short_conv_kernel_size": 4},
        bos_token_id=163584, eos_token_id=163586, pad_token_id=163839, model_max_length=8192)},
}

SPEC = ModelSpec(
    model_type="kimi_linear",
    architectures=("KimiLinearForCausalLM",),
    parse_config=parse_config,
    model=KimiLinearForCausalLM,
    split_plan=split_plan,
    # Stored in float32 by the official checkpoint, whatever its dtype (the seed's converter notes the same four).
    fp32_tensors=("A_log", "dt_bias", "e_score_correction_bias", "conv1d.weight"),
    tensor_role=tensor_role,
    routed_experts=r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$",
    mxfp4_ignore=("lm_head", "re:.*embed_tokens.*", "re:.*self_attn.*", "re:.*shared_experts.*",
                  "re:.*block_sparse_moe\\.gate$", "re:.*mlp\\.(gate|up|down)_proj.*",
                  "re:.*routed_expert_(down|up)_proj.*"),
    tiny_presets=PRESETS,
    random_weight=random_weight,
)
