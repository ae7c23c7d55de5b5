"""`deltaserve convert SRC DST --experts mxfp4`: rewrite a checkpoint with MXFP4 routed experts, streaming one
source shard at a time (peak memory: one shard), in the compressed-tensors layout vLLM loads."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from .checkpoint import INDEX, checkpoint_files, scan
from .config import MXFP4_FORMAT, ConfigError, read_config
from .models.registry import spec_for
from .ops.mxfp4 import quantize_mxfp4

TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "tokenization_kimi.py")
# compressed-tensors' description of MXFP4 routed experts; `ignore` comes from the model family.
QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": MXFP4_FORMAT,
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "format": MXFP4_FORMAT,
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
                    "dynamic": False, "scale_dtype": "torch.uint8"},
        "input_activations": None,
        "output_activations": None,
    }},
}


def convert(src: str | Path, dst: str | Path, experts: str = "mxfp4", force: bool = False,
            progress: bool | None = None) -> dict[str, int]:
    """Write the converted checkpoint; returns byte counts before and after."""
    src, dst = Path(src), Path(dst)
    if experts != "mxfp4":
        raise ValueError(f"--experts {experts!r}: only mxfp4 is supported")
    raw = read_config(src)
    spec = spec_for(raw)
    if spec.parse_config(raw, None).experts_mxfp4:
        raise ConfigError(f"{src}: the routed experts are already MXFP4")
    quantization = {**QUANTIZATION_CONFIG, "ignore": list(spec.mxfp4_ignore)}
    spec.parse_config(raw, {"quantization_config": quantization})          # divisibility checks up front
    routed = re.compile(spec.routed_experts)
    if dst.resolve() == src.resolve():
        raise ValueError(f"{dst}: the destination is the source; convert into another directory")
    if dst.exists() and any(dst.iterdir()) and not force:
        raise FileExistsError(f"{dst}: not empty; pass --force to overwrite")
    tensors = scan(src)                                    # validates every shard before writing anything
    dst.mkdir(parents=True, exist_ok=True)
    files = checkpoint_files(src)
    weight_map: dict[str, str] = {}
    written = 0
    bar = tqdm(total=sum(t.nbytes for t in tensors.values()), unit="B", unit_scale=True, desc="converting",
               disable=None if progress is None else not progress)
    with bar:
        for i, file in enumerate(files):
            out_name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            out = {}
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    if routed.search(name):
                        base = name[: -len("weight")]
                        out[base + "weight_packed"], out[base + "weight_scale"] = quantize_mxfp4(tensor)
                    else:
                        out[name] = tensor
                    bar.update(tensors[name].nbytes)
            save_file(out, dst / out_name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(out, out_name))
            written += sum(t.numel() * t.element_size() for t in out.values())
            del out
    (dst / INDEX).write_text(json.dumps({"metadata": {"total_size": written}, "weight_map": weight_map}, indent=2))
    (dst / "config.json").write_text(json.dumps({**raw, "quantization_config": quantization}, indent=2))
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    return {"source_bytes": sum(t.nbytes for t in tensors.values()), "converted_bytes": written}
