"""The compiled model on a CPU (torch.compile, inductor): the decode step of 1..8 sequences, through two graphs, one
for a single sequence and one for 2..8 (that dimension symbolic), compiled at first use; the engine's warmup uses
both, so a server never compiles while a request waits. (Prefill runs eagerly: its time is in large matrix products
and in the KDA chunk kernel, csrc/cpu_gemv.cpp.)

Decode compiles to the model's own operators (the kernels of csrc/cpu_gemv.cpp, registered with torch) called from
one generated C++ function, with the small ops between them fused into inductor's C++ loops; the per-module Python
of an eager step is gone. No shape depends on the slots or the sequence lengths: the kernels read and write the
state pool in place by slot index (state.py `slot_ids`, `positions`). Roundings follow eager (inductor's
`emulate_precision_casts`): bf16 decode logits equal eager's bit for bit at batch 1 where bf16 products are widened
to fp32 (CPUs without bf16 arithmetic), else within one bf16 rounding.
Compiled graphs are cached on disk by inductor (TORCHINDUCTOR_CACHE_DIR, default ~/.cache/deltaserve/inductor/<ISA>),
so a restart redoes only the Python-level trace. Off with `enforce_eager`.
"""
from __future__ import annotations

import itertools
import os
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .ops.cpu_kernels import MAX_ROWS, kernels
from .state import StateView


def enforce_eager_default() -> bool:
    """`enforce_eager` when not given: the DELTASERVE_ENFORCE_EAGER environment variable (1: eager)."""
    return os.environ.get("DELTASERVE_ENFORCE_EAGER", "0") == "1"


def can_compile(model: nn.Module) -> bool:
    """The compiled decode step needs the CPU decode kernels for every decode-time op of the model (their in-place,
    slot-indexed state updates; no host-side expert grouping) and one process."""
    return (next(model.parameters()).device.type == "cpu" and kernels() is not None and model.tp.size == 1
            and model.dtype in (torch.float32, torch.bfloat16) and not model.cfg.expert_input_mxfp8)


_code_ids = itertools.count()


def own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with a code object of its own. Dynamo keeps compiled graphs and their guards per code object, so a
    closure over one model made this way holds that model's graphs alone."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{next(_code_ids)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class Compiled:
    """`fn` through torch.compile, one graph per key the caller gives (which shapes it covers), compiled at the key's
    first call; a key whose compile fails is reported once and then returns None, so the caller runs eagerly. The
    nn.Modules `fn` reads must never change once compiled: their guards are dropped."""

    def __init__(self, what: str, fn: Callable[..., Any]):
        self.what = what
        # cpp_wrapper: the generated code calls its kernels from C++, not Python (decode measured 13-23% faster than
        # eager on bench-s, vs 7-10% with inductor's Python wrapper). No size asserts: the C++ wrapper checks every
        # input and every custom op's output shape with a std::stringstream built per check, 224 a bench-s decode step
        # (the fake shapes are checked once, by the compiled-vs-eager tests)
        options = {"emulate_precision_casts": True, "cpp_wrapper": True,
                   "size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
        skip_modules = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)    # torch >= 2.8
        if skip_modules is not None:
            # a decode step's guards were 1,084 checks, 880 of them on the model's modules and weights, evaluated
            # before every step; the inputs' guards (which graph: 1 row or 2..8) stay
            options["guard_filter_fn"] = skip_modules
        self.compiled = torch.compile(fn, fullgraph=True, options=options)
        self.compile_seconds: dict[int, float] = {}     # key -> its compiling call
        self.failed: set[int] = set()

    def __call__(self, key: int, *args: Any, **kwargs: Any) -> Any:
        if key in self.compile_seconds:
            # inference mode inside the graph too: the ops it calls then skip autograd's dispatch (views without
            # autograd metadata), a tenth of a bench-s decode step's overhead; it is part of the graph's guards
            with torch.inference_mode():
                return self.compiled(*args, **kwargs)
        if key in self.failed:
            return None
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                out = self.compiled(*args, **kwargs)
        # tracing or inductor failed (e.g. no C++ compiler), before anything ran
        except torch._dynamo.exc.TorchDynamoException as e:
            lines = str(e).splitlines()         # a compiler's own message, not the command line before it
            reason = next((line for line in lines if "error:" in line), str(e)[:300])
            print(f"deltaserve: compiling the {self.what} failed ({type(e).__name__}: {reason}); "
                  "running it eagerly", file=sys.stderr)
            self.failed.add(key)
            return None
        self.compile_seconds[key] = time.perf_counter() - t0
        return out


def _symbolic(tensors: tuple[torch.Tensor, ...], dim: int, size: int, most: int) -> int:
    """Mark `dim` of each tensor symbolic for sizes 2..most: one graph for all of them (size 1 is its own graph, as
    torch specialises it); returns the graph key, 1 or 2."""
    if size > 1:
        for t in tensors:
            torch._dynamo.mark_dynamic(t, dim, min=2, max=most)
    return min(size, 2)


def configure_inductor() -> None:
    """Trust the CPU's flags for inductor's vector ISA, and keep compiled graphs in one directory per ISA unless the
    user set TORCHINDUCTOR_CACHE_DIR."""
    # inductor checks each vector ISA the CPU's flags list by building a test library and loading it in a new Python
    # process: seconds of each cold start, and a probe that fails (seen twice here) silently turns the ISA off for the
    # process, so vectorized code from the disk cache is then built without its flags and fails to compile. The CPU's
    # flags, which inductor reads either way, decide instead.
    if torch._inductor.config.cpp.vec_isa_ok is None:
        torch._inductor.config.cpp.vec_isa_ok = True
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    # inductor's graph cache is not keyed by the vector ISA: a cache written on an AVX-512 machine and read under AVX2
    # (a shared directory, or ATEN_CPU_CAPABILITY=avx2) gave loops stepping 16 floats built for 8-float vectors, which
    # computed NaNs. Importing torch._dynamo sets torch's default (/tmp/torchinductor_<user>): that is replaced too.
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        isa = "-".join(str(pick_vec_isa()).lower().split())         # e.g. avx2, "avx512 avx512_vnni"
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deltaserve" / "inductor" / isa
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)


class CompiledModel:
    """The compiled decode step of one model (its forward for one new token per row)."""

    def __init__(self, model: nn.Module):
        configure_inductor()
        def decode(tokens: torch.Tensor, state: StateView) -> torch.Tensor:
            return model(tokens, state, last_only=True)
        # this model's own graphs: the model is fixed once loaded, so its guards are dropped
        self.decode = Compiled("decode step", own_code(decode))

    def decodes(self, tokens: torch.Tensor) -> bool:
        return tokens.shape[1] == 1 and tokens.shape[0] <= MAX_ROWS

    def decode_step(self, tokens: torch.Tensor, state: StateView) -> torch.Tensor | None:
        """Logits of each row's next token, [B, vocab]; None if this graph could not be compiled."""
        key = _symbolic((tokens, state.slot_ids, state.positions), 0, tokens.shape[0], MAX_ROWS)
        return self.decode(key, tokens, state)

    @property
    def compile_times(self) -> dict[str, float]:
        """Seconds each compiled graph's first call took, by name."""
        return {f"decode step ({'1' if key == 1 else '2+'})": t for key, t in self.decode.compile_seconds.items()}
