"""The KDA kernels, behind fla's names and signatures (`chunk_kda`, `fused_recurrent_kda`): fla's Triton kernels on
CUDA when flash-linear-attention is installed, else deltaserve's PyTorch forms (delta_rule.py). Chosen once per
layer, by device."""
from __future__ import annotations

import functools
from typing import Callable

import torch

from . import delta_rule

Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@functools.cache
def kda_kernels(device_type: str, chunk_size: int = 64) -> tuple[Kernel, Kernel]:
    """(chunk, recurrent): each (q, k, v, g, beta, scale, initial_state) -> (o [B, T, H, V], final state), with q and
    k already L2-normalised and g the log-decay. fla's chunk size is its own (64)."""
    if device_type == "cuda":
        try:
            from fla.ops.kda import chunk_kda, fused_recurrent_kda
        except ImportError:
            pass
        else:
            def fla(kernel: Kernel) -> Kernel:
                return lambda q, k, v, g, beta, scale, initial_state: kernel(
                    q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True)
            return fla(chunk_kda), fla(fused_recurrent_kda)
    return functools.partial(delta_rule.chunk_kda, chunk_size=chunk_size), delta_rule.fused_recurrent_kda
