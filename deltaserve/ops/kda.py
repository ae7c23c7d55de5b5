"""The KDA kernels, behind fla's names and signatures (`chunk_kda`, `fused_recurrent_kda`): fla's Triton kernels on
CUDA when flash-linear-attention is installed, else deltaserve's PyTorch forms (delta_rule.py), whose chunk-parallel
part runs on a CPU as one operator of csrc/cpu_gemv.cpp where it applies. Chosen once per layer, by device."""
from __future__ import annotations

import functools
from typing import Callable

import torch

from . import delta_rule
from .cpu_kernels import kernels

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
    prepare = cpu_chunk_prepare if device_type == "cpu" else delta_rule.chunk_prepare
    chunk = functools.partial(delta_rule.chunk_kda, chunk_size=chunk_size, prepare=prepare)
    return chunk, delta_rule.fused_recurrent_kda


def cpu_chunk_prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
                      ) -> tuple[torch.Tensor, ...]:
    """delta_rule.chunk_prepare through the CPU kernel, which keeps each chunk of each head in registers and a
    scratch buffer instead of [C, C, K] decay tensors (bench-s, 4 heads, 256 tokens: 2.6 ms compiled by inductor,
    0.6 ms as the kernel); the PyTorch form where there is no kernel or a head width is not a multiple of 16."""
    ops = kernels()
    if ops is None or k.shape[-1] % 16 or v.shape[-1] % 16:
        return delta_rule.chunk_prepare(q, k, v, g, beta)
    return tuple(ops.kda_chunk_prepare(*(t.contiguous() for t in (q, k, v, g, beta))))
