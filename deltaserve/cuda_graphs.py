"""Decode steps on CUDA as CUDA graphs: the model's forward for 1..8 sequences, captured once per (batch size,
attention span) and replayed with new tokens, slots and lengths copied into the graph's input tensors. An eager
decode step launches some hundreds of small kernels from Python; a replay launches them all at once.

The captured step reads its slots and lengths only from device tensors (state.py `graph_view`), the routed experts
run without a host sync (layers/moe.py `experts_gathered`) and MLA attends over a fixed span of positions, masked
beyond each row's length: spans are powers of two from 256 up to the context, so a step attends over at most twice
the positions it needs. Capture runs against a scratch slot the engine never assigns. All graphs share one memory
pool, captured largest first (vLLM's order) so the smaller ones reuse its blocks.
"""
from __future__ import annotations

import torch
from torch import nn

from .ops.cpu_kernels import MAX_ROWS
from .state import StatePool

MIN_SPAN = 256


def attention_spans(max_len: int) -> list[int]:
    """The spans graphs are captured for: powers of two from MIN_SPAN below the context, and the context."""
    return [MIN_SPAN << i for i in range(64) if MIN_SPAN << i < max_len] + [max_len]


def can_graph(model: nn.Module) -> bool:
    """CUDA, one process, and routed experts of dense weights (MXFP4 / int8 experts group tokens on the host)."""
    from .layers.moe import MoE
    return (next(model.parameters()).device.type == "cuda" and model.tp.size == 1
            and all(m.gathers_experts for m in model.modules() if isinstance(m, MoE)))


class CudaGraphs:
    def __init__(self, model: nn.Module, pool: StatePool, scratch_slot: int):
        self.model, self.pool, self.scratch = model, pool, scratch_slot
        device = pool.device
        self.tokens = torch.zeros(MAX_ROWS, 1, dtype=torch.long, device=device)
        self.slot_ids = torch.full((MAX_ROWS,), scratch_slot, dtype=torch.long, device=device)
        self.positions = torch.zeros(MAX_ROWS, dtype=torch.long, device=device)
        self.spans = attention_spans(pool.max_len)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.memory_pool = torch.cuda.graph_pool_handle()

    def span(self, length: int) -> int:
        """The smallest span holding `length` positions."""
        return next(s for s in self.spans if s >= length)

    def capture_all(self) -> None:
        for span in reversed(self.spans):
            for batch in range(MAX_ROWS, 0, -1):
                self.capture(batch, span)

    def capture(self, batch: int, span: int) -> None:
        if (batch, span) in self.graphs:
            return
        self.slot_ids.fill_(self.scratch)
        self.positions.zero_()
        tokens = self.tokens[:batch]
        # views made before capturing (making one reads the slots to the host, which a capture forbids), one per
        # run: a view keeps the attention mask it first builds, and the captured one must build its own
        first_view, captured_view = (self.pool.graph_view(self.slot_ids[:batch], self.positions[:batch], span)
                                     for _ in range(2))
        side = torch.cuda.Stream()          # a first run (cuBLAS handles, Triton autotuning) outside the capture
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model(tokens, first_view, last_only=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            logits = self.model(tokens, captured_view, last_only=True)
        self.graphs[batch, span] = graph, logits

    def step(self, tokens: torch.Tensor, slots: list[int], starts: list[int]) -> torch.Tensor:
        """Logits [B, vocab] of one new token per row (tokens [B, 1] on the device), through the graph of this
        batch size and the smallest span that holds every row's new position."""
        batch, length = len(slots), max(starts) + 1
        if length > self.pool.max_len:
            raise ValueError(f"sequence of {length} tokens exceeds the state's {self.pool.max_len}")
        span = self.span(length)
        self.capture(batch, span)
        graph, logits = self.graphs[batch, span]
        self.tokens[:batch].copy_(tokens)
        self.slot_ids[:batch].copy_(torch.tensor(slots), non_blocking=True)
        self.positions[:batch].copy_(torch.tensor(starts), non_blocking=True)
        graph.replay()
        return logits.clone()
