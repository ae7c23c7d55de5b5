"""The tensor-parallel communicator the model computes with: this process's rank and the two collectives a
Megatron-style split needs. Processes, the split plan and the rank-0 runner live elsewhere (parallel.py, models/)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TP:
    """This process's place in the tensor-parallel group (size 1: no communication at all)."""
    rank: int = 0
    size: int = 1

    def share(self, n: int) -> slice:
        """This rank's part of a dimension of n split evenly across the group."""
        part = n // self.size
        return slice(self.rank * part, (self.rank + 1) * part)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial results (after a row-parallel matmul), in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension (vocab-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)
