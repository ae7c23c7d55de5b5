"""Read official safetensors checkpoints: find shards, parse headers, validate names and shapes, then fill
the model's tensors one at a time (each converted to its target dtype and dropped), so peak memory stays
near the size of the loaded model. Under tensor parallelism each rank reads only its slice of split tensors."""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from .distributed import TP
from .models.spec import SplitPlan

INDEX = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and tensor."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = SAFETENSORS_DTYPES[self.dtype].itemsize if self.dtype in SAFETENSORS_DTYPES else 1
        for d in self.shape:
            n *= d
        return n


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Tensor metadata of one safetensors file, without reading tensor data. Checks the file is complete."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise CheckpointError(f"{file}: shard file is missing") from None
    except (struct.error, ValueError, UnicodeDecodeError, MemoryError, OverflowError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    data_end = max((v["data_offsets"][1] for v in header.values()), default=0)
    size, expected = os.path.getsize(file), 8 + length + data_end
    if size < expected:
        raise CheckpointError(f"{file}: truncated shard: {size} bytes on disk, its header needs {expected}")
    return {name: TensorInfo(file, v["dtype"], tuple(v["shape"])) for name, v in header.items()}


def checkpoint_files(path: str | Path) -> list[Path]:
    """The shard files of a checkpoint directory: from its index, else `model.safetensors`, else any *.safetensors."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    index = root / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        # shards are files of this directory (a hub snapshot's own may be links out of it; its index names are not)
        outside = next((f for f in files if not isinstance(f, str) or Path(f).name != f or f in ("", ".", "..")),
                       None)
        if outside is not None:
            raise CheckpointError(f"{index}: shard {outside!r} is not a file name in {root}")
        return [root / f for f in files]
    files = [root / "model.safetensors"] if (root / "model.safetensors").exists() else sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no model.safetensors, {INDEX} or *.safetensors files")
    return files


def scan(path: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint with its file, dtype and shape (headers only)."""
    tensors: dict[str, TensorInfo] = {}
    for file in checkpoint_files(path):
        tensors.update(read_header(file))
    index = Path(path) / INDEX
    if index.exists():
        for name, file in json.loads(index.read_text())["weight_map"].items():
            if name not in tensors:
                raise CheckpointError(f"{index}: lists tensor {name} in {file}, but that shard does not hold it")
    return tensors


def _same_shape(found: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """Equal up to singleton dimensions (e.g. conv taps stored [C, 1, W] or [C, W])."""
    return tuple(d for d in found if d != 1) == tuple(d for d in expected if d != 1)


NO_SPLIT = SplitPlan(())


def full_shape(name: str, local: torch.Size, tp: TP, plan: SplitPlan) -> tuple[int, ...]:
    """The checkpoint shape of a tensor whose rank-local slice is `local` (split by the TP plan)."""
    shape, d = list(local), plan.dim(name) if tp.size > 1 else None
    if d is not None:
        shape[d] *= tp.size
    return tuple(shape)


def validate(tensors: dict[str, TensorInfo], targets: dict[str, torch.Tensor], root: str | Path,
             tp: TP = TP(), plan: SplitPlan = NO_SPLIT, prefix: str = "") -> None:
    """Every target present with its shape and a compatible dtype, and nothing else under `prefix`."""
    missing = sorted(set(targets) - set(tensors))
    if missing:
        shown = ", ".join(f"{n} (expected shape {list(full_shape(n, targets[n].shape, tp, plan))})"
                          for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{root}: missing tensor(s) {shown}{more}")
    unexpected = sorted(n for n in tensors if n.startswith(prefix) and n not in targets)
    if unexpected:
        shown = ", ".join(f"{n} in {tensors[n].file.name}" for n in unexpected[:5])
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise CheckpointError(f"{root}: unexpected tensor(s) {shown}{more}")
    for name, target in targets.items():
        info, expected = tensors[name], full_shape(name, target.shape, tp, plan)
        if not _same_shape(info.shape, expected):
            raise CheckpointError(f"{info.file}: tensor {name} has shape {list(info.shape)}, expected {list(expected)}")
        if info.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{info.file}: tensor {name} has unsupported dtype {info.dtype}")
        if (info.dtype == "U8") != (target.dtype == torch.uint8):   # packed bytes are never cast to or from floats
            expected = "U8 (packed MXFP4)" if target.dtype == torch.uint8 else "a floating-point dtype"
            raise CheckpointError(f"{info.file}: tensor {name} has dtype {info.dtype}, expected {expected}")


@torch.inference_mode()
def load_into(targets: dict[str, torch.Tensor], path: str | Path, progress: bool | None = None,
              tp: TP = TP(), plan: SplitPlan = NO_SPLIT, prefix: str = "") -> None:
    """Validate the whole checkpoint against `targets` (full checkpoint names) first, then copy each tensor into its
    target, reading only this rank's slice of each tensor the plan splits. Tensors outside `prefix` (a multimodal
    checkpoint's vision tower) are never read."""
    tensors = scan(path)
    validate(tensors, targets, path, tp, plan, prefix)
    by_file: dict[Path, list[str]] = {}
    for name in targets:
        by_file.setdefault(tensors[name].file, []).append(name)
    bar = tqdm(total=sum(tensors[n].nbytes for n in targets), unit="B", unit_scale=True, desc="loading",
               disable=None if progress is None else not progress, leave=False)
    with bar:
        for file, names in by_file.items():
            try:
                with safe_open(file, framework="pt", device="cpu") as f:
                    for name in names:
                        target = targets[name]
                        d = plan.dim(name) if tp.size > 1 else None
                        if d is None:
                            source = f.get_tensor(name)
                        else:                            # read only this rank's rows / columns from disk
                            index = [slice(None)] * len(tensors[name].shape)
                            index[d] = tp.share(tensors[name].shape[d])
                            source = f.get_slice(name)[tuple(index)]
                        target.copy_(source.reshape(target.shape))
                        bar.update(tensors[name].nbytes // tp.size if d is not None else tensors[name].nbytes)
            except CheckpointError:
                raise
            except Exception as e:   # safetensors / IO errors surface with the file that caused them
                raise CheckpointError(f"{file}: failed to read ({type(e).__name__}: {e})") from None
