"""Where CUDA exists: fla's KDA kernels (chosen by ops/kda.py when flash-linear-attention is installed) equal
deltaserve's PyTorch forms, and a model on CUDA equals the CPU one. Skipped, with the reason, elsewhere."""
import subprocess
import sys
import textwrap

import pytest
import torch

from deltaserve import LLM

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Run apart from conftest.py, which hides fla from transformers (the CPU oracle).
FLA_PARITY = textwrap.dedent("""
    import importlib.util, sys, torch
    if importlib.util.find_spec("fla") is None:
        print("no fla"); sys.exit(0)
    from deltaserve.ops import delta_rule
    from deltaserve.ops.kda import kda_kernels
    chunk, recurrent = kda_kernels("cuda")
    assert chunk is not kda_kernels("cpu")[0], "fla's kernels were not chosen"
    g = torch.Generator().manual_seed(0)
    for T in (1, 100):
        q, k = (delta_rule.l2norm(torch.randn(2, T, 4, 64, generator=g)) for _ in range(2))
        v, decay = torch.randn(2, T, 4, 64, generator=g), -torch.rand(2, T, 4, 64, generator=g) * 3
        beta, s0 = torch.rand(2, T, 4, generator=g), torch.randn(2, 4, 64, 64, generator=g)
        ref_o, ref_s = delta_rule.chunk_kda(q, k, v, decay, beta, 64 ** -0.5, s0)
        o, s = (recurrent if T == 1 else chunk)(*(x.cuda() for x in (q, k, v, decay, beta)), 64 ** -0.5, s0.cuda())
        assert (o.float().cpu() - ref_o).abs().max() <= 1e-3 and (s.float().cpu() - ref_s).abs().max() <= 1e-3, T
    print("ok")
""")


@cuda
def test_fla_kernels_equal_the_pytorch_forms():
    out = subprocess.run([sys.executable, "-c", FLA_PARITY], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "no fla":
        pytest.skip("flash-linear-attention (fla) is not installed")
    assert out.stdout.strip() == "ok"


@cuda
def test_model_on_cuda_equals_cpu(tiny_dir):
    ids = list(range(3, 150))
    cpu = LLM(tiny_dir, dtype="float32").logits(ids)
    gpu = LLM(tiny_dir, dtype="float32", device="cuda").logits(ids)
    assert (gpu.cpu() - cpu).abs().max() <= 1e-3
