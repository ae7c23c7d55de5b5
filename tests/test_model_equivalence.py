"""Equivalent ways to compute the same thing agree: prefill vs decode, chunked vs recurrent, chunk sizes, dtypes."""
import pytest
import torch

from deltaserve import LLM
from deltaserve.ops.cpu_kernels import kernels
from deltaserve.ops.delta_rule import chunk_kda, chunk_prepare, fused_recurrent_kda, l2norm
from deltaserve.state import StatePool


def kernel_prepare(*chunks):
    return tuple(kernels().kda_chunk_prepare(*(c.contiguous() for c in chunks)))


# the chunk-parallel part of chunked KDA: the PyTorch form, and the CPU kernel (ops/kda.py's choice on a CPU)
PREPARES = [pytest.param(chunk_prepare, id="torch"),
            pytest.param(kernel_prepare, id="cpu-kernel", marks=pytest.mark.skipif(
                kernels() is None, reason="needs the CPU kernels (x86 with AVX2 or AVX-512 and a C++ compiler)"))]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, dtype="float32")


def prompt(n, seed=0):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_then_decode_equals_full_forward(llm):
    ids = prompt(130)
    full = llm.logits(ids)
    pool = StatePool(llm.model.state_spec(), 1, len(ids))
    stepwise = [llm.model(torch.tensor([ids[:100]]), pool.view([0], [0]))[0]]
    for t in range(100, len(ids)):
        stepwise.append(llm.model(torch.tensor([[ids[t]]]), pool.view([0], [t]))[0])
    assert (torch.cat(stepwise) - full).abs().max() <= 1e-4


@pytest.mark.parametrize("prepare", PREPARES)
@pytest.mark.parametrize("T", [1, 5, 64, 100, 129])
def test_chunked_delta_rule_equals_recurrent(T, prepare):
    g = torch.Generator().manual_seed(T)
    B, H, K, V = 2, 3, 16, 32
    q, k = l2norm(torch.randn(B, T, H, K, generator=g)), l2norm(torch.randn(B, T, H, K, generator=g))
    v = torch.randn(B, T, H, V, generator=g)
    decay = -torch.rand(B, T, H, K, generator=g) * 4
    beta = torch.rand(B, T, H, generator=g)
    s0 = torch.randn(B, H, K, V, generator=g)
    o_rec, s_rec = fused_recurrent_kda(q, k, v, decay, beta, K ** -0.5, s0.clone())
    for chunk in (16, 24, 64):             # 24: no sub-chunks of 16, the chunk is one block
        o, s = chunk_kda(q, k, v, decay, beta, K ** -0.5, s0, chunk, prepare)
        assert (o - o_rec).abs().max() <= 1e-5 and (s - s_rec).abs().max() <= 1e-5


@pytest.mark.parametrize("prepare", PREPARES)
def test_chunked_delta_rule_is_stable_under_strong_decay(prepare):
    """exp(-cumulative decay) overflows float32 here; the pairwise form must not."""
    g = torch.Generator().manual_seed(0)
    q, k = l2norm(torch.randn(1, 64, 2, 16, generator=g)), l2norm(torch.randn(1, 64, 2, 16, generator=g))
    v, beta, s0 = torch.randn(1, 64, 2, 16, generator=g), torch.rand(1, 64, 2, generator=g), torch.zeros(1, 2, 16, 16)
    decay = torch.full((1, 64, 2, 16), -50.0)
    o, s = chunk_kda(q, k, v, decay, beta, 16 ** -0.5, s0, 64, prepare)
    o_rec, _ = fused_recurrent_kda(q, k, v, decay, beta, 16 ** -0.5, s0.clone())
    assert torch.isfinite(o).all() and (o - o_rec).abs().max() <= 1e-5


def test_chunk_sizes_agree(tiny_dir, llm):
    ids = prompt(150, seed=1)
    small = LLM(tiny_dir, dtype="float32", chunk_size=16).logits(ids)
    assert (small - llm.logits(ids)).abs().max() <= 1e-4


def test_bfloat16_is_finite_and_close_to_float32(tiny_dir, llm):
    ids = prompt(90, seed=2)
    ref = llm.logits(ids)
    bf16 = LLM(tiny_dir, dtype="bfloat16").logits(ids)
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16).all()
    # Max error is dominated by the odd router flip (transformers' own bf16 shows the same); judge the bulk.
    assert (bf16 - ref).abs().mean() <= 0.1 * ref.abs().mean()   # transformers: 8.5%, ours: 6.4%
    assert (bf16.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85


@pytest.mark.parametrize("dtype,widened", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_prefill_experts_sum_as_one_index_add_per_expert(tiny_dir, dtype, widened, monkeypatch):
    """Bitwise: the routed experts of a prefill chunk (the CPU kernel, or the loop grouped by one sort) give what the
    reference's loop gives, each expert's weighted results rounded to the activation dtype and added to its tokens in
    ascending expert order. `widened`: as on a CPU without bf16 arithmetic (bf16 products of 4+ rows in fp32)."""
    from deltaserve.layers import linear
    from deltaserve.layers.moe import route
    if widened:
        monkeypatch.setattr(linear, "CPU_BF16_ARITHMETIC", False)
    # 4 experts a token: with 2, one rounding of their sum is all either way
    llm = LLM(tiny_dir, dtype=dtype, enforce_eager=True, hf_overrides={"num_experts_per_token": 4})
    moe = next(m for m in llm.runner.model.modules() if type(m).__name__ == "MoE")
    if kernels() is not None:           # the kernel is what runs here, not the loop
        assert moe._prefill_kernels(torch.zeros(9, moe.cfg.hidden_size, dtype=dtype)) is not None
    # 12 tokens: experts of up to 8 rows too (the GEMV kernel's products); 3,000 on 3 threads: each expert's
    # activation is big enough for ATen to split it among threads, at places an all-rows call would not split
    threads = torch.get_num_threads()
    for n, t in ((100, threads), (12, threads), (3000, 3)):
        torch.set_num_threads(t)
        try:
            h = torch.randn(n, moe.cfg.hidden_size, generator=torch.Generator().manual_seed(n)).to(dtype)
            ids, weights = route(h, moe.gate_weight, moe.e_score_correction_bias, moe.cfg)
            expected = torch.zeros_like(h)
            for e in sorted(set(ids.flatten().tolist())):
                tokens, j = (ids == e).nonzero(as_tuple=True)
                y = moe.expert(e, h[tokens], lambda t: t) * weights[tokens, j, None]
                expected.index_add_(0, tokens, y.to(dtype))
            with torch.inference_mode():
                assert torch.equal(moe.experts(h, ids, weights), expected)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_in_query_blocks_equals_all_at_once(tiny_dir, dtype, monkeypatch):
    """A long prefill's attention scores are held a block of queries at a time (layers/mla.py SCORES_PER_BLOCK);
    with a budget that splits every chunk into blocks of a few queries, the logits are the ones all at once (up to
    the products' rounding: a small block can take another matmul kernel), and no block holds more scores than the
    budget allows."""
    from deltaserve.layers import mla
    model = LLM(tiny_dir, dtype=dtype).model
    ids = prompt(300, seed=4)
    pool = StatePool(model.state_spec(), 1, len(ids))
    whole = torch.cat([model(torch.tensor([ids[s:s + 128]]), pool.view([0], [s]), last_only=False)[0]
                       for s in range(0, len(ids), 128)])
    budget, held = 1000, []
    monkeypatch.setattr(mla, "SCORES_PER_BLOCK", budget)
    real = mla._attend
    monkeypatch.setattr(mla, "_attend", lambda q, k, *a: held.append(q.shape[1] * q.shape[2] * k.shape[2])
                        or real(q, k, *a))
    pool = StatePool(model.state_spec(), 1, len(ids))
    blocks = torch.cat([model(torch.tensor([ids[s:s + 128]]), pool.view([0], [s]), last_only=False)[0]
                        for s in range(0, len(ids), 128)])
    assert len(held) > 3 * len(ids) // 128 and max(held) <= budget
    assert (blocks - whole).abs().max() <= (1e-5 if dtype == torch.float32 else 0.05 * whole.abs().max())
