"""deltaserve's CPU decode kernels (csrc/cpu_gemv.cpp): matrix-vector products for 1..8 rows against fp32, bf16
and MXFP4 weights, at memory speed. Built once with the C++ toolchain torch uses (during set-up;
cached by torch.utils.cpp_extension) and loaded at model load, never while
a request waits. Absent (None) on CPUs without AVX-512, where the build fails, or with DELTASERVE_CPU_KERNELS=0:
callers then use PyTorch's own ops."""
from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).parent.parent / "csrc" / "cpu_gemv.cpp"
MAX_ROWS = 8
# -fopenmp: at::parallel_for is a header template that runs serially unless the extension itself is built with
# OpenMP (measured: a 1 GiB bf16 GEMV at 11.5 GB/s on 2 threads without it, 26.9 GB/s with it); libgomp resolves to
# the copy torch has already loaded, so both share one thread pool
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp"]


@functools.cache
def kernels() -> ModuleType | None:
    if os.environ.get("DELTASERVE_CPU_KERNELS", "1") == "0" or not torch.cpu._is_avx512_supported():
        return None
    from torch.utils.cpp_extension import load
    # one build per source version, so installs (and checkouts) of different versions never rebuild over each other
    name = "deltaserve_cpu_gemv_" + hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:12]
    try:
        return load(name, [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler or headers: serve with PyTorch's ops instead
        print(f"deltaserve: CPU decode kernels unavailable ({type(e).__name__}: {e}); using PyTorch's ops",
              file=sys.stderr)
        return None
