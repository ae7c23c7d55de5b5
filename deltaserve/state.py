"""Per-sequence model state, kept outside the layers: a pool of slots, views of a batch of slots, snapshots.

A slot holds one sequence's
  - KDA short-conv windows: the last W-1 pre-conv q|k|v projections   [W-1, 3P]      (activation dtype)
  - KDA recurrent matrices                                            [H, K, V]      (always float32)
  - MLA compressed latent cache: normalised c_kv | k_pe per token      [max_len, r+rope] (activation dtype)
per layer of that kind. The engine owns slots; the model reads and writes them through a `StateView`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig


@dataclass
class Snapshot:
    """An exact copy of one slot's state after `length` tokens (same dtypes, so restoring is bit-identical),
    with the logits at its last position, so a request that adds nothing can sample without recomputing."""
    length: int
    conv: dict[int, torch.Tensor]
    recurrent: dict[int, torch.Tensor]
    latent: dict[int, torch.Tensor]
    logits: torch.Tensor
    id: int = -1                       # the runner's handle (under tensor parallelism, each rank holds a part)

    @property
    def nbytes(self) -> int:
        tensors = [*self.conv.values(), *self.recurrent.values(), *self.latent.values(), self.logits]
        return sum(t.numel() * t.element_size() for t in tensors)


class StatePool:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", kda_heads: int | None = None, mla_width: int | None = None):
        """kda_heads: heads held here (fewer than cfg's under tensor parallelism)."""
        self.num_slots, self.max_len = num_slots, max_len
        H = kda_heads or cfg.kda_num_heads
        K = cfg.kda_head_dim
        W = cfg.conv_kernel_size
        width = mla_width or cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.conv = {i: torch.zeros(num_slots, W - 1, 3 * H * K, dtype=dtype, device=device) for i in cfg.kda_layers}
        self.recurrent = {i: torch.zeros(num_slots, H, K, K, dtype=torch.float32, device=device) for i in cfg.kda_layers}
        self.latent = {i: torch.zeros(num_slots, max_len, width, dtype=dtype, device=device) for i in cfg.mla_layers}

    def view(self, slots: list[int], starts: list[int]) -> "StateView":
        return StateView(self, slots, starts)

    def reset(self, slot: int) -> None:
        """Forget a slot's recurrent state (the latent cache is overwritten from position 0 and masked)."""
        for t in (*self.conv.values(), *self.recurrent.values()):
            t[slot].zero_()

    def snapshot(self, slot: int, length: int, logits: torch.Tensor) -> Snapshot:
        return Snapshot(length,
                        {i: t[slot].clone() for i, t in self.conv.items()},
                        {i: t[slot].clone() for i, t in self.recurrent.items()},
                        {i: t[slot, :length].clone() for i, t in self.latent.items()},
                        logits.clone())

    def restore(self, slot: int, snap: Snapshot) -> None:
        for i, t in self.conv.items():
            t[slot].copy_(snap.conv[i])
        for i, t in self.recurrent.items():
            t[slot].copy_(snap.recurrent[i])
        for i, t in self.latent.items():
            t[slot, :snap.length].copy_(snap.latent[i])



class StateView:
    """The state of a batch: row b is slot `slots[b]`, which already holds `starts[b]` tokens."""

    def __init__(self, pool: StatePool, slots: list[int], starts: list[int]):
        self.pool, self.slots, self.starts = pool, slots, starts
        device = next(iter({**pool.recurrent, **pool.latent}.values())).device
        contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        self.rows = slice(slots[0], slots[0] + len(slots)) if contiguous else torch.tensor(slots, device=device)
        self.device = device
        self._mask: tuple[int, torch.Tensor, int] | None = None

    def kda(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv window [B, W-1, 3P], recurrent state [B, H, K, V]): views of the pool when the slots are
        contiguous (updates in place land directly), else gathered copies; either way, hand back via set_kda."""
        return self.pool.conv[layer][self.rows], self.pool.recurrent[layer][self.rows]

    def set_kda(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        for pool, new in ((self.pool.conv[layer], conv), (self.pool.recurrent[layer], recurrent)):
            if not (isinstance(self.rows, slice) and new.data_ptr() == pool[self.rows].data_ptr()):
                pool[self.rows] = new

    def mla(self, layer: int, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append latents [B, T, C] at each row's position; return (cache [B, L, C], attend mask [B, 1, T, L])."""
        B, T, _ = latents.shape
        cache = self.pool.latent[layer]
        if max(self.starts) + T > self.pool.max_len:
            raise ValueError(f"sequence of {max(self.starts) + T} tokens exceeds the state's {self.pool.max_len}")
        if B == 1:
            cache[self.slots[0], self.starts[0]:self.starts[0] + T] = latents[0]
        else:
            pos = torch.tensor(self.starts, device=self.device)[:, None] + torch.arange(T, device=self.device)
            cache[torch.tensor(self.slots, device=self.device)[:, None], pos] = latents
        mask, L = self.attend_mask(T)
        return cache[self.rows, :L], mask

    def attend_mask(self, T: int) -> tuple[torch.Tensor, int]:
        """Key p is visible to query t of row b iff p <= starts[b] + t (causal, per-row length)."""
        if self._mask is None or self._mask[0] != T:
            L = max(self.starts) + T
            starts = torch.tensor(self.starts, device=self.device)
            query_pos = starts[:, None] + torch.arange(T, device=self.device)                 # [B, T]
            mask = torch.arange(L, device=self.device)[None, None, :] <= query_pos[:, :, None]  # [B, T, L]
            self._mask = (T, mask.unsqueeze(1), L)
        return self._mask[1], self._mask[2]
