"""`deltaserve inspect`: what a checkpoint holds and what serving it costs, from headers and index only (never
tensor data). All figures are exact byte counts."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from .checkpoint import INDEX, TensorInfo, scan
from .config import ModelConfig
from .models.kimi_linear import KimiLinearForCausalLM
from .parallel import split_dim
from .tiny import FP32_TENSORS

DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "F64": 8, "I64": 8, "I32": 4, "F8_E4M3": 1, "F8_E5M2": 1}
ROLES = (
    ("routed_experts", re.compile(r"\.experts\.\d+\.")),
    ("shared_experts", re.compile(r"\.shared_experts\.")),
    ("router", re.compile(r"\.block_sparse_moe\.gate\.")),
    ("dense_mlp", re.compile(r"\.mlp\.")),
    ("embeddings", re.compile(r"(embed_tokens|lm_head)\.weight$")),
    ("norms", re.compile(r"(layernorm|norm)\.weight$")),
)


def role(name: str, cfg: ModelConfig) -> str:
    for label, pattern in ROLES:
        if pattern.search(name):
            return label
    if ".self_attn." in name:
        return "kda" if cfg.is_kda(int(name.split(".")[2])) else "mla"
    return "other"


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of the official layout for this config (bf16 unless stored fp32 or packed)."""
    with torch.device("meta"):
        targets = KimiLinearForCausalLM(cfg).checkpoint_map()
    store = "F16" if cfg.torch_dtype == "float16" else "F32" if cfg.torch_dtype == "float32" else "BF16"
    return {n: (tuple(t.shape), "U8" if t.dtype == torch.uint8 else "F32" if n.endswith(FP32_TENSORS) else store)
            for n, t in targets.items()}


def audit(path: str | Path, context: int = 4096, tp: int = 1, metadata_only: bool = False,
          device_memory: int | None = None, max_num_seqs: int = 8, dtype: str | None = None) -> dict[str, Any]:
    root = Path(path)
    cfg = ModelConfig.from_path(root)
    expected = expected_tensors(cfg)
    if metadata_only:     # config.json (and the index, if present): shapes and dtypes of the expected layout
        weight_map = (json.loads((root / INDEX).read_text())["weight_map"] if (root / INDEX).exists()
                      else dict.fromkeys(expected, "(not present)"))
        tensors = {n: TensorInfo(root / f, *(expected.get(n, ((), "?"))[::-1])) for n, f in weight_map.items()}
    else:
        tensors = scan(root)
    present = {n: t for n, t in tensors.items() if n in expected}
    nbytes = {n: _bytes(t) for n, t in present.items()}

    by_dtype: dict[str, int] = {}
    by_role: dict[str, int] = {}
    for n, t in present.items():
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + nbytes[n]
        by_role[role(n, cfg)] = by_role.get(role(n, cfg), 0) + nbytes[n]
    per_device = sum(b // tp if split_dim(n) is not None else b for n, b in nbytes.items())

    act = {"float32": 4}.get(dtype or cfg.torch_dtype, 2)       # activation / cache bytes per value
    latent = len(cfg.mla_layers) * context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * act
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size
    recurrent = len(cfg.kda_layers) * (H * K * K * 4 + (W - 1) * 3 * H * K * act)
    snapshot = recurrent + latent + cfg.vocab_size * 4
    shards = sorted({t.file for t in tensors.values() if t.file.name != "(not present)"})
    report: dict[str, Any] = {
        "model": str(root),
        "shards": [{"file": f.name, "bytes": f.stat().st_size if f.exists() else None} for f in shards],
        "tensor_count": len(tensors),
        "bytes_by_dtype": dict(sorted(by_dtype.items())),
        "bytes_by_role": dict(sorted(by_role.items())),
        "total_bytes": sum(nbytes.values()),
        "parameters": sum(_numel(t.shape) * (2 if t.dtype == "U8" and n.endswith("weight_packed") else 1)
                          for n, t in present.items() if not n.endswith("weight_scale")),
        "missing": sorted(set(expected) - set(tensors)),
        "unexpected": sorted(set(tensors) - set(expected)),
        "shape_mismatches": sorted(n for n, t in present.items() if not metadata_only and
                                   tuple(d for d in t.shape if d != 1) != tuple(d for d in expected[n][0] if d != 1)),
        "tensor_parallel_size": tp,
        "weight_bytes_per_device": per_device,
        "context": context,
        "mla_latent_cache_bytes_per_sequence": latent,
        "recurrent_state_bytes_per_sequence": recurrent,
        "recurrent_state_bytes_per_sequence_per_device": recurrent // tp,
        "prefix_snapshot_bytes_per_conversation": snapshot,
    }
    if device_memory is not None:
        need = per_device + max_num_seqs * (latent + recurrent // tp)
        report["device_memory"] = device_memory
        report["bytes_needed_per_device"] = need
        report["fits"] = need <= device_memory
    return report


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _bytes(t: TensorInfo) -> int:
    return _numel(t.shape) * DTYPE_BYTES.get(t.dtype, 1)


def format_report(r: dict[str, Any]) -> str:
    gb = lambda b: f"{b:,} B ({b / 1e9:.2f} GB)"
    lines = [f"model: {r['model']}",
             f"shards: {len(r['shards'])}, tensors: {r['tensor_count']}, parameters: {r['parameters']:,}",
             f"weights: {gb(r['total_bytes'])}"]
    lines += [f"  {k:<16} {gb(v)}" for k, v in r["bytes_by_dtype"].items()]
    lines += ["by role:"] + [f"  {k:<16} {gb(v)}" for k, v in r["bytes_by_role"].items()]
    for key in ("missing", "unexpected", "shape_mismatches"):
        if r[key]:
            lines.append(f"{key.replace('_', ' ')} ({len(r[key])}): {', '.join(r[key][:5])}"
                         + (" ..." if len(r[key]) > 5 else ""))
    lines += [f"weights per device at TP {r['tensor_parallel_size']}: {gb(r['weight_bytes_per_device'])}",
              f"MLA latent cache per sequence at {r['context']:,} tokens: {gb(r['mla_latent_cache_bytes_per_sequence'])}",
              f"recurrent state per sequence: {gb(r['recurrent_state_bytes_per_sequence'])}"
              f" ({gb(r['recurrent_state_bytes_per_sequence_per_device'])} per device)",
              f"prefix snapshot per cached conversation of {r['context']:,} tokens: "
              f"{gb(r['prefix_snapshot_bytes_per_conversation'])}"]
    if "fits" in r:
        verdict = "fits" if r["fits"] else "does NOT fit"
        lines.append(f"{verdict}: needs {gb(r['bytes_needed_per_device'])} per device of {gb(r['device_memory'])}")
    return "\n".join(lines)
