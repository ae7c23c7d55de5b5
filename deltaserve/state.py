"""Per-sequence model state, kept outside the layers: a pool of slots, views of a batch of slots, snapshots.

Each layer declares its state (`state_spec()`: name -> StateSpec); the pool allocates one tensor per (layer, name)
with a leading slot dimension, plus a position dimension for per-token caches. For Kimi Linear that is, per layer
  - KDA: the short-conv window of the last W-1 pre-conv q|k|v inputs, and the recurrent matrices [H, K, V] (fp32)
  - MLA: the compressed latent cache, c_kv | k_pe per position.
The engine owns slots; the model reads and writes them through a `StateView`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .models.spec import StateSpec

Key = tuple[int, str]           # (layer, state name)


@dataclass
class Snapshot:
    """An exact copy of one slot's state after `length` tokens (same dtypes, so restoring is bit-identical),
    with the logits at its last position, so a request that adds nothing can sample without recomputing."""
    length: int
    state: dict[Key, torch.Tensor]
    logits: torch.Tensor
    id: int = -1                       # the runner's handle (under tensor parallelism, each rank holds a part)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.state.values(), self.logits))


class StatePool:
    def __init__(self, spec: dict[int, dict[str, StateSpec]], num_slots: int, max_len: int,
                 device: torch.device | str = "cpu"):
        self.num_slots, self.max_len = num_slots, max_len
        self.per_token = {(i, n): s.per_token for i, layer in spec.items() for n, s in layer.items()}
        self.tensors = {(i, n): torch.zeros(num_slots, *((max_len,) if s.per_token else ()), *s.shape,
                                            dtype=s.dtype, device=device)
                        for i, layer in spec.items() for n, s in layer.items()}
        self.device = torch.device(device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def view(self, slots: list[int], starts: list[int]) -> "StateView":
        return StateView(self, slots, starts)

    def graph_view(self, slot_ids: torch.Tensor, positions: torch.Tensor, span: int) -> "StateView":
        """A decode view whose every tensor op reads the slots and lengths from `slot_ids` and `positions` (device
        tensors the caller refills), with attention over the first `span` positions: the same work whatever their
        values, so a CUDA graph captured once replays for any of them (lengths below `span`, checked by the caller)."""
        return StateView(self, slot_ids.tolist(), positions.tolist(), span, slot_ids, positions)

    def reset(self, slot: int) -> None:
        """Forget a slot's recurrent state (caches are overwritten from position 0 and masked beyond)."""
        for key, t in self.tensors.items():
            if not self.per_token[key]:
                t[slot].zero_()

    def snapshot(self, slot: int, length: int, logits: torch.Tensor) -> Snapshot:
        return Snapshot(length, {key: (t[slot, :length] if self.per_token[key] else t[slot]).clone()
                                 for key, t in self.tensors.items()}, logits.clone())

    def restore(self, slot: int, snap: Snapshot) -> None:
        for key, t in self.tensors.items():
            (t[slot, :snap.length] if self.per_token[key] else t[slot]).copy_(snap.state[key])


class StateView:
    """The state of a batch: row b is slot `slots[b]`, which already holds `starts[b]` tokens. The same as tensors
    (`slot_ids`, `positions`) for decode kernels that work in place on the pool, whose shapes then do not depend
    on the slots or lengths (what a compiled decode step needs)."""

    def __init__(self, pool: StatePool, slots: list[int], starts: list[int], span: int | None = None,
                 slot_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        self.pool, self.slots, self.starts, self.span = pool, slots, starts, span
        self.device = pool.device
        self.slot_ids = torch.tensor(slots, device=self.device) if slot_ids is None else slot_ids
        self.positions = torch.tensor(starts, device=self.device) if positions is None else positions
        contiguous = span is None and slots == list(range(slots[0], slots[0] + len(slots)))
        self.rows = slice(slots[0], slots[0] + len(slots)) if contiguous else self.slot_ids

    def pool_tensor(self, layer: int, name: str) -> torch.Tensor:
        """All slots' state (name) of a layer, [slots, ...], for kernels that index it by `slot_ids`."""
        return self.pool.tensors[layer, name]

    def get(self, layer: int, name: str) -> torch.Tensor:
        """A recurrent state of this batch [B, ...]: a view of the pool when the slots are contiguous (updates in
        place land directly), else a gathered copy; either way, hand a new value back through `put`."""
        return self.pool.tensors[layer, name][self.rows]

    def put(self, layer: int, name: str, value: torch.Tensor) -> None:
        pool = self.pool.tensors[layer, name]
        if not (isinstance(self.rows, slice) and value.data_ptr() == pool[self.rows].data_ptr()):
            pool[self.rows] = value

    def append(self, layer: int, name: str, values: torch.Tensor) -> torch.Tensor:
        """Write per-token values [B, T, C] at each row's position; return the cache [B, L, C] the rows' queries
        attend over: L is the longest row's length after the write (or the view's span). Which of those positions
        each query sees: `query_positions`."""
        B, T, _ = values.shape
        cache = self.pool.tensors[layer, name]
        values = values.to(cache.dtype)
        if self.span is None and max(self.starts) + T > self.pool.max_len:
            raise ValueError(f"sequence of {max(self.starts) + T} tokens exceeds the state's {self.pool.max_len}")
        if B == 1 and self.span is None:
            cache[self.slots[0], self.starts[0]:self.starts[0] + T] = values[0]
        else:
            cache[self.slot_ids[:, None], self.query_positions(T)] = values
        return cache[self.rows, :max(self.starts) + T if self.span is None else self.span]

    def query_positions(self, T: int) -> torch.Tensor:
        """[B, T]: the position of each row's t-th new token. Key p is visible to it iff p <= that (causal, per-row
        length)."""
        return self.positions[:, None] + torch.arange(T, device=self.device)
