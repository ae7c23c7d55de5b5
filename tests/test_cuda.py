"""Where CUDA exists: fla's KDA kernels (chosen by ops/kda.py when flash-linear-attention is installed) equal
deltaserve's PyTorch forms, and a model on CUDA equals the CPU one. Skipped, with the reason, elsewhere."""
import subprocess
import sys
import textwrap

import pytest
import torch

from deltaserve import LLM, SamplingParams

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


def decode_steps(llm: LLM, graphs: bool, steps: int = 3) -> torch.Tensor:
    """Logits of `steps` decode steps of three sequences (different lengths, non-contiguous slots) from fresh
    prompts, through the runner's CUDA graphs or eagerly."""
    runner, saved = llm.runner, llm.runner.graphs
    slots, prompts = [4, 0, 2], [list(range(3, 20)), list(range(5, 300)), [7]]
    for slot, p in zip(slots, prompts):
        runner.reset(slot)
        runner.forward([p], [slot], [0])
    runner.graphs = saved if graphs else None
    out = [runner.forward([[t + i] for t in (11, 12, 13)], slots, [len(p) + i for p in prompts])
           for i in range(steps)]
    runner.graphs = saved
    return torch.stack(out)


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_equals_eager(tiny_dir, dtype):
    """Graph replays (spans 256 and 512: a prompt past the first span) against eager steps, and the engine's
    warmup captures every graph, so serving captures none."""
    llm = LLM(tiny_dir, dtype=dtype, device="cuda", enforce_eager=False, max_model_len=600, warmup=True)
    graphs = llm.runner.graphs
    assert graphs is not None and len(graphs.graphs) == 8 * len(graphs.spans) == 24
    replayed, eager = decode_steps(llm, True), decode_steps(llm, False)
    if dtype == "float32":
        assert (replayed - eager).abs().max() <= 1e-4
    else:
        assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out = llm.generate([list(range(3, 40 + i)) for i in range(3)], greedy)
    assert len(graphs.graphs) == 24
    if dtype == "float32":
        llm.runner.graphs = None
        llm.engine.cache.clear()
        again = llm.generate([list(range(3, 40 + i)) for i in range(3)], greedy)
        assert [o.token_ids for o in out] == [o.token_ids for o in again]
