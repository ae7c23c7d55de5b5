"""deltaserve's CPU kernels (csrc/cpu_gemv.cpp): for decode, matrix-vector products for 1..8 rows against fp32,
bf16, int8 and MXFP4 weights at memory speed and the fused layer steps; for prefill, chunked KDA and the routed
experts. Built once with the C++ toolchain torch uses (during set-up; cached by torch.utils.cpp_extension) and loaded
at model load, never while a request waits. Absent (None) on CPUs without AVX2, where the build fails, or with
DELTASERVE_CPU_KERNELS=0: callers then use PyTorch's own ops."""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).parent.parent / "csrc" / "cpu_gemv.cpp"
MAX_ROWS = 8
# -fopenmp: at::parallel_for is a header template that runs serially unless the extension itself is built with
# OpenMP (measured: a 1 GiB bf16 GEMV at 11.5 GB/s on 2 threads without it, 26.9 GB/s with it); libgomp resolves to
# the copy torch has already loaded, so both share one thread pool
# -ffp-contract=off: scalar loops that mirror the op-by-op path's roundings (routed-expert sums, RMSNorm, KDA) must not
# have a product and a sum fused into one FMA; the explicit FMA intrinsics are unaffected
COMMON_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
# the kernels are written once against 16-float vectors: one AVX-512 register or two AVX2 ones (csrc/cpu_gemv.cpp)
ISA_FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"], "AVX2": ["-mavx2", "-mfma", "-mf16c"]}


def build_flags() -> list[str] | None:
    """The compiler flags for this CPU's vector width (torch's own detection, ATEN_CPU_CAPABILITY included), or None
    on CPUs without AVX2."""
    isa = ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability())
    return None if isa is None else COMMON_FLAGS + isa


_loaded: dict[str, Any] = {}      # a plain dict, not functools.cache: torch.compile reads it without a graph break


def kernels() -> Any:
    """The operators' namespace, torch.ops.<build name> (gemv, gemv_q8, gemv_mxfp4, rms_norm, kda_decode_step,
    mla_decode, routed_experts, argmax, top_k; kda_chunk_inputs, kda_chunk_prepare, routed_experts_prefill), or None."""
    if "ops" not in _loaded:
        _loaded["ops"] = _load()
    return _loaded["ops"]


def _load() -> Any:
    flags = build_flags()
    if os.environ.get("DELTASERVE_CPU_KERNELS", "1") == "0" or flags is None:
        return None
    from torch.utils.cpp_extension import load
    # one build per source version and vector width, so installs (and checkouts) of different versions never rebuild
    # over each other
    name = "deltaserve_cpu_gemv_" + hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    try:
        load(name, [str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False,
             verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler or headers: serve with PyTorch's ops instead
        print(f"deltaserve: CPU decode kernels unavailable ({type(e).__name__}: {e}); using PyTorch's ops",
              file=sys.stderr)
        return None
    _register_shapes(name)
    return getattr(torch.ops, name)


def fused_decode(weight: torch.Tensor) -> bool:
    """Whether a layer with this weight decodes through the fused kernels: on a CPU, in fp32 or bf16."""
    return weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)


def _rows_out(x: torch.Tensor, n: int, float_out: bool = False) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], n, dtype=torch.float32 if float_out else x.dtype)


def _register_shapes(ns: str) -> None:
    """Output shapes and dtypes of each operator, for tracing (torch.compile) without running it."""
    def fake(op: str):
        return torch.library.register_fake(f"{ns}::{op}")
    fake("gemv")(lambda x, W, float_out=False: _rows_out(x, W.shape[0], float_out))
    fake("gemv_q8")(lambda x, q, scales, float_out=False: _rows_out(x, q.shape[0], float_out))
    fake("gemv_mxfp4")(lambda x, packed, scales, float_out=False: _rows_out(x, packed.shape[0], float_out))
    fake("rms_norm")(lambda x, weight, eps: torch.empty_like(x, memory_format=torch.contiguous_format))
    fake("argmax")(lambda x: x.new_empty(x.shape[:-1], dtype=torch.long))
    fake("top_k")(lambda scores, k: scores.new_empty(scores.shape[0], k, dtype=torch.long))
    fake("kda_decode_step")(lambda proj, conv, taps, f_a, f_b, dt_bias, decay, lower_bound, beta_logit, g, g_b,
                            o_norm, eps, silu_gate, per_channel, state, slots:
                            proj.new_empty(proj.shape[0], state.shape[1] * state.shape[2]))
    fake("mla_decode")(lambda q, w_uk, w_uv, cache, latent, slots, positions, scale:
                       q.new_empty(q.shape[0], q.shape[1] * w_uv.shape[1]))
    fake("routed_experts")(lambda h, ids, weights, w13, w2, situ, beta, linear_beta, shared_gate_up, shared_down:
                           (torch.empty_like(h), h.new_empty(h.shape[0] if shared_gate_up else 0, h.shape[1])))
