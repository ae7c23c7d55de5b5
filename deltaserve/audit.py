"""`deltaserve inspect`: what a checkpoint holds and what serving it costs, from headers and index only (never
tensor data). All figures are exact byte counts, from the family's declarations: its tensor names and shapes,
stored dtypes, split plan and state."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .checkpoint import INDEX, TensorInfo, checkpoint_files, scan
from .distributed import TP
from .models.registry import load_config
from .models.spec import ModelSpec

DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "F64": 8, "I64": 8, "I32": 4, "F8_E4M3": 1, "F8_E5M2": 1}
STORED = {"float16": "F16", "float32": "F32"}          # else bf16, as released


def expected_tensors(spec: ModelSpec, cfg: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """Full checkpoint name -> (shape, dtype) of the official layout for this config."""
    with torch.device("meta"):
        targets = spec.model(cfg).checkpoint_map()
    store = STORED.get(cfg.torch_dtype, "BF16")
    return {spec.checkpoint_prefix + n: (tuple(t.shape), "U8" if t.dtype == torch.uint8 else
                                         "F32" if n.endswith(spec.fp32_tensors) else store)
            for n, t in targets.items()}


def state_bytes(spec: ModelSpec, cfg: Any, dtype: torch.dtype, tp: int) -> tuple[int, int]:
    """(recurrent state bytes per sequence on one device, cache bytes per token on one device)."""
    with torch.device("meta"):
        layers = spec.model(cfg, dtype, tp=TP(0, tp)).state_spec()
    recurrent = per_token = 0
    for states in layers.values():
        for s in states.values():
            n = _numel(s.shape) * s.dtype.itemsize
            if s.per_token:
                per_token += n
            else:
                recurrent += n
    return recurrent, per_token


def audit(path: str | Path, context: int = 4096, tp: int = 1, metadata_only: bool = False,
          device_memory: int | None = None, max_num_seqs: int = 8, dtype: str | None = None) -> dict[str, Any]:
    root = Path(path)
    spec, cfg = load_config(root)
    expected = expected_tensors(spec, cfg)
    index = json.loads((root / INDEX).read_text()) if (root / INDEX).exists() else None
    if metadata_only:     # config.json (and the index, if present): shapes and dtypes of the expected layout
        if index:
            checkpoint_files(root)                    # its shard names, checked as a load checks them
        weight_map = index["weight_map"] if index else dict.fromkeys(expected, "(not present)")
        tensors = {n: TensorInfo(root / f, *(expected.get(n, ((), "?"))[::-1])) for n, f in weight_map.items()}
    else:
        tensors = scan(root)
    present = {n: t for n, t in tensors.items() if n in expected}
    nbytes = {n: _bytes(t) for n, t in present.items()}
    plan = spec.split_plan(cfg)

    by_dtype: dict[str, int] = {}
    by_role: dict[str, int] = {}
    for n, t in present.items():
        role = spec.tensor_role(n, cfg)
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + nbytes[n]
        by_role[role] = by_role.get(role, 0) + nbytes[n]
    per_device = sum(b // tp if tp > 1 and plan.dim(n) is not None else b for n, b in nbytes.items())

    act = {"float32": torch.float32, "float16": torch.float16}.get(dtype or cfg.torch_dtype, torch.bfloat16)
    recurrent, per_token = state_bytes(spec, cfg, act, 1)
    recurrent_local, per_token_local = state_bytes(spec, cfg, act, tp)
    latent, latent_local = context * per_token, context * per_token_local
    shards = sorted({t.file for t in tensors.values() if t.file.name != "(not present)"})
    report: dict[str, Any] = {
        "model": str(root),
        "architecture": spec.architectures[0],
        "shards": [{"file": f.name, "bytes": f.stat().st_size if f.exists() else None} for f in shards],
        "tensor_count": len(tensors),
        "skipped_tensors": sum(not n.startswith(spec.checkpoint_prefix) for n in tensors),
        "bytes_by_dtype": dict(sorted(by_dtype.items())),
        "bytes_by_role": dict(sorted(by_role.items())),
        "total_bytes": sum(nbytes.values()),
        "index_total_size": (index or {}).get("metadata", {}).get("total_size"),
        "parameters": sum(_numel(t.shape) * (2 if t.dtype == "U8" and n.endswith("weight_packed") else 1)
                          for n, t in present.items() if not n.endswith("weight_scale")),
        "missing": sorted(set(expected) - set(tensors)),
        "unexpected": sorted(n for n in tensors if n.startswith(spec.checkpoint_prefix) and n not in expected),
        "shape_mismatches": sorted(n for n, t in present.items() if not metadata_only and
                                   tuple(d for d in t.shape if d != 1) != tuple(d for d in expected[n][0] if d != 1)),
        "tensor_parallel_size": tp,
        "weight_bytes_per_device": per_device,
        "context": context,
        "mla_latent_cache_bytes_per_sequence": latent,
        "mla_latent_cache_bytes_per_sequence_per_device": latent_local,
        "recurrent_state_bytes_per_sequence": recurrent,
        "recurrent_state_bytes_per_sequence_per_device": recurrent_local,
        "prefix_snapshot_bytes_per_conversation": recurrent + latent + cfg.vocab_size * 4,
    }
    if device_memory is not None:
        need = per_device + max_num_seqs * (latent_local + recurrent_local)
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
    lines = [f"model: {r['model']} ({r['architecture']})",
             f"shards: {len(r['shards'])}, tensors: {r['tensor_count']} ({r['skipped_tensors']} outside the text "
             f"model, never read), parameters: {r['parameters']:,}",
             f"weights: {gb(r['total_bytes'])}" + (f" of the index's {gb(r['index_total_size'])}"
                                                    if r["index_total_size"] else "")]
    lines += [f"  {k:<20} {gb(v)}" for k, v in r["bytes_by_dtype"].items()]
    lines += ["by role:"] + [f"  {k:<20} {gb(v)}" for k, v in r["bytes_by_role"].items()]
    for key in ("missing", "unexpected", "shape_mismatches"):
        if r[key]:
            lines.append(f"{key.replace('_', ' ')} ({len(r[key])}): {', '.join(r[key][:5])}"
                         + (" ..." if len(r[key]) > 5 else ""))
    lines += [f"weights per device at TP {r['tensor_parallel_size']}: {gb(r['weight_bytes_per_device'])}",
              f"MLA latent cache per sequence at {r['context']:,} tokens: {gb(r['mla_latent_cache_bytes_per_sequence'])}"
              f" ({gb(r['mla_latent_cache_bytes_per_sequence_per_device'])} per device)",
              f"recurrent state per sequence: {gb(r['recurrent_state_bytes_per_sequence'])}"
              f" ({gb(r['recurrent_state_bytes_per_sequence_per_device'])} per device)",
              f"prefix snapshot per cached conversation of {r['context']:,} tokens: "
              f"{gb(r['prefix_snapshot_bytes_per_conversation'])}"]
    if "fits" in r:
        verdict = "fits" if r["fits"] else "does NOT fit"
        lines.append(f"{verdict}: needs {gb(r['bytes_needed_per_device'])} per device of {gb(r['device_memory'])}")
    return "\n".join(lines)
