"""ModelRunner: the model and its state pool behind the few operations the engine needs (forward, reset,
snapshot, restore, release). Tokens in, logits out; the engine never touches tensors of the model's state."""
from __future__ import annotations

import itertools

import torch
from torch import nn

from .compiled import CompiledModel, can_compile
from .cuda_graphs import CudaGraphs, can_graph
from .ops.cpu_kernels import MAX_ROWS
from .state import Snapshot, StatePool


class ModelFailure(RuntimeError):
    """The model or its devices failed (e.g. a tensor-parallel rank died): no request can be served any more."""


class ModelRunner:
    def __init__(self, model: nn.Module, num_slots: int, max_len: int, compile: bool = False):
        """`model`: a registered family's model (models/spec.py): forward(tokens, state, last_only), state_spec().
        `compile`: on a CPU, decode steps of 1..8 sequences through torch.compile where it applies (compiled.py); on
        CUDA, decode steps of 1..8 sequences as CUDA graphs (cuda_graphs.py)."""
        self.model, self.cfg = model, model.cfg
        self.compiled = CompiledModel(model) if compile and can_compile(model) else None
        self.chunk_size = model.chunk_size
        self.device = next(model.parameters()).device
        graphs = compile and can_graph(model)
        # with CUDA graphs, one more slot than the engine assigns: the graphs' capture runs write there
        self.pool = StatePool(model.state_spec(), num_slots + int(graphs), max_len, self.device)
        self.graphs = CudaGraphs(model, self.pool, scratch_slot=num_slots) if graphs else None
        self._snapshot_ids = itertools.count()
        self.snapshots: dict[int, Snapshot] = {}      # this process's part of each live snapshot

    def forward(self, tokens: list[list[int]], slots: list[int], starts: list[int], last_only: bool = True
                ) -> torch.Tensor:
        """Append each row of `tokens` to its slot; logits of each row's last position, [B, vocab] float32 (of
        every position, [B, T, vocab], without `last_only`)."""
        batch = torch.tensor(tokens, device=self.device)
        if last_only and self.graphs is not None and batch.shape[1] == 1 and batch.shape[0] <= MAX_ROWS:
            return self.graphs.step(batch, slots, starts)
        state = self.pool.view(slots, starts)
        if last_only and self.compiled is not None and self.compiled.decodes(batch):
            logits = self.compiled.decode_step(batch, state)
            if logits is not None:
                return logits
        return self.model(batch, state, last_only=last_only)

    def warm(self) -> None:
        """Capture every CUDA graph now (the engine's warmup), not at each one's first use."""
        if self.graphs is not None:
            self.graphs.capture_all()

    def logits(self, ids: list[int], step: int) -> torch.Tensor:
        """Logits at every position of a fresh sequence, computed `step` tokens at a time in a private pool."""
        pool = StatePool(self.model.state_spec(), 1, len(ids), self.device)
        batch = torch.tensor([ids], device=self.device)
        return torch.cat([self.model(batch[:, s:s + step], pool.view([0], [s]))[0] for s in range(0, len(ids), step)])

    def reset(self, slot: int) -> None:
        self.pool.reset(slot)

    def snapshot(self, slot: int, length: int, logits: torch.Tensor, snapshot_id: int | None = None) -> Snapshot:
        snap = self.pool.snapshot(slot, length, logits)
        snap.id = next(self._snapshot_ids) if snapshot_id is None else snapshot_id
        self.snapshots[snap.id] = snap
        return snap

    def restore(self, slot: int, snap: Snapshot | int) -> None:
        self.pool.restore(slot, self.snapshots[snap if isinstance(snap, int) else snap.id])

    def release(self, snap: Snapshot | int) -> None:
        """The prefix cache dropped this snapshot."""
        self.snapshots.pop(snap if isinstance(snap, int) else snap.id, None)
