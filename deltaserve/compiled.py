"""The compiled decode step: torch.compile (inductor) of one decode step of 1..8 sequences on a CPU, one graph per
batch size, compiled the first time that batch size decodes (the engine's warmup decodes at every size, so a
server never compiles while a request waits).

What it compiles to: the model's own operators (the decode kernels of csrc/cpu_gemv.cpp, registered with torch)
called from one generated function, with the small ops between them fused into inductor's C++ loops; the
per-module Python of an eager step is gone. Shapes are static: the kernels read and write the state pool in place
by slot index (state.py `slot_ids`, `positions`), so a step's shapes depend only on its batch size.
Roundings follow eager (inductor's `emulate_precision_casts`): bf16 logits equal eager's bit for bit at batch 1.
Compiled graphs are cached on disk by inductor (TORCHINDUCTOR_CACHE_DIR, default ~/.cache/deltaserve/inductor),
so a restart recompiles only the Python-level trace. Turned off by `enforce_eager` (CLI `--enforce-eager`).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from .ops.cpu_kernels import MAX_ROWS, kernels
from .state import StateView


def enforce_eager_default() -> bool:
    """`enforce_eager` when not given: the DELTASERVE_ENFORCE_EAGER environment variable (1: eager)."""
    return os.environ.get("DELTASERVE_ENFORCE_EAGER", "0") == "1"


def can_compile(model: nn.Module) -> bool:
    """Compiled decode needs the CPU decode kernels (their in-place, slot-indexed state updates) and one process."""
    return next(model.parameters()).device.type == "cpu" and kernels() is not None and model.tp.size == 1


class CompiledDecode:
    def __init__(self, model: nn.Module):
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deltaserve" / "inductor"
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))
        # two graphs per model: room for several models in one process (tests, A/B scripts)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * MAX_ROWS)
        # cpp_wrapper: the generated step calls its kernels from C++, not Python (measured 13-23% faster than
        # eager on bench-s vs 7-10% with inductor's Python wrapper)
        self.step = torch.compile(model, fullgraph=True, options={"emulate_precision_casts": True, "cpp_wrapper": True})
        self.compile_seconds: dict[int, float] = {}     # graph (1: one sequence, 2: 2..8) -> its compiling call
        self.failed = False

    def applies(self, tokens: torch.Tensor) -> bool:
        return not self.failed and tokens.shape[1] == 1 and tokens.shape[0] <= MAX_ROWS

    def __call__(self, tokens: torch.Tensor, state: StateView) -> torch.Tensor | None:
        """Logits of each row's next token, [B, vocab]; None when compiling failed (the caller runs eagerly)."""
        batch = tokens.shape[0]
        graph = min(batch, 2)
        if batch > 1:            # one graph for every batch of 2..8 rows (one is its own: size-1 dims specialise)
            for t in (tokens, state.slot_ids, state.positions):
                torch._dynamo.mark_dynamic(t, 0, min=2, max=MAX_ROWS)
        if graph in self.compile_seconds:
            return self.step(tokens, state, last_only=True)
        t0 = time.perf_counter()
        try:
            logits = self.step(tokens, state, last_only=True)
        except Exception as e:  # noqa: BLE001 - e.g. no C++ compiler for inductor: serve eagerly, say why once
            print(f"deltaserve: compiling the decode step failed ({type(e).__name__}: {str(e)[:300]}); running eagerly",
                  file=sys.stderr)
            self.failed = True
            return None
        self.compile_seconds[graph] = time.perf_counter() - t0
        return logits
