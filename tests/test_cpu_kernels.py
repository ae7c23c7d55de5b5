"""The CPU kernels equal PyTorch's products, and a row's result does not depend on the other rows."""
import os

import pytest
import torch

from deltaserve.ops.cpu_kernels import build_flags, kernels
from deltaserve.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from deltaserve.tiny import make_tiny

k = kernels()
# a build error on a CPU the kernels are for fails here (test_the_kernels_build), not skips every test
pytestmark = pytest.mark.skipif(build_flags() is None or os.environ.get("DELTASERVE_CPU_KERNELS") == "0",
                                reason="needs an x86 CPU with AVX2 or AVX-512 (and the kernels not turned off)")


def test_the_kernels_build():
    assert k is not None, "the CPU kernels failed to build (see the compiler's output above)"


@pytest.mark.parametrize("dtype,x_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                           (torch.bfloat16, torch.bfloat16)])   # bf16 x bf16: pairs where AVX512-BF16 is there
@pytest.mark.parametrize("K", [512, 96, 100])      # 96: one 32-pair step and a tail; 100: shorter than a vector
def test_gemv_equals_float64_reference(dtype, x_dtype, K):
    g = torch.Generator().manual_seed(K)
    W = torch.randn(300, K, generator=g).to(dtype)
    x = torch.randn(8, K, generator=g).to(x_dtype)
    ref = (x.double() @ W.double().T)
    rounding = 2.0 ** -8 if x_dtype == torch.bfloat16 else 1e-5    # results are written in x's dtype
    for M in range(1, 9):
        got = k.gemv(x[:M], W)
        assert got.dtype == x_dtype
        assert (got.double() - ref[:M]).abs().max() <= rounding * ref.abs().max()


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8", "mxfp4"])
def test_results_are_rounded_to_the_input_dtype_once(weights, x_dtype):
    """Bitwise: a product's results in x's dtype are its fp32 results rounded once (written directly for bf16), and
    `float_out` (logits) gives those rounded values in fp32."""
    from deltaserve.ops.int8 import quantize_int8
    g = torch.Generator().manual_seed(2)
    W = torch.randn(300, 512, generator=g)
    x = torch.randn(8, 512, generator=g).to(x_dtype)
    run = {"fp32": lambda rows, *f: k.gemv(rows, W, *f), "bf16": lambda rows, *f: k.gemv(rows, W.bfloat16(), *f),
           "int8": lambda rows, *f: k.gemv_q8(rows, *quantize_int8(W), *f),
           "mxfp4": lambda rows, *f: k.gemv_mxfp4(rows, *quantize_mxfp4(W), *f)}[weights]
    for M in (1, 3, 8):
        rounded, float_out = run(x[:M]), run(x[:M], True)
        assert rounded.dtype == x_dtype and float_out.dtype == torch.float32
        assert torch.equal(float_out, rounded.float())
        if not (weights == "bf16" and x_dtype == torch.bfloat16):     # bf16 x bf16: its own products (pairs)
            assert torch.equal(rounded, run(x[:M].float()).to(x_dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torchs(dtype):
    """The first largest value, NaN first of all, for lengths around the 16-wide vector and a vocabulary."""
    g = torch.Generator().manual_seed(3)
    for n in (1, 15, 16, 17, 100, 32000):
        rows = torch.randn(6, n, generator=g).to(dtype)
        rows[1, n // 2:] = rows[1].max()                      # ties: the first one wins
        rows[2] = float("-inf")
        rows[3, n // 3] = float("nan")
        rows[3, -1] = float("nan")
        rows[4] = 0.0
        rows[4, n - 1] = -0.0                                  # -0 and +0 are equal
        rows[5, -1] = float("inf")
        assert torch.equal(k.argmax(rows), rows.argmax(-1)), n
        assert [int(k.argmax(row)) for row in rows] == rows.argmax(-1).tolist()


def test_amx_is_used_where_the_cpu_has_it():
    flags = open("/proc/cpuinfo").read().split()
    expected = {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(flags) and os.environ.get("DELTASERVE_AMX") != "0" \
        and torch.backends.cpu.get_cpu_capability() == "AVX512"
    assert k.uses_amx() == expected


def test_top_k_is_a_stable_descending_sorts_first_k():
    """A router's choice: ties to the lower index, NaN first of all, -0 and +0 equal, rows of -inf."""
    g = torch.Generator().manual_seed(4)
    for E, k_ in ((16, 4), (256, 8), (896, 16)):
        scores = torch.randint(0, 12, (70, E), generator=g).float() / 12        # many exact ties
        scores[1, E // 2] = scores[1, -1] = float("nan")
        scores[2] = float("-inf")
        scores[3] = 0.0
        scores[3, ::3] = -0.0
        scores[4, :k_] = float("inf")
        expected = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k_]
        assert torch.equal(k.top_k(scores, k_), expected), E


def test_mxfp4_gemv_equals_the_dequantized_product():
    g = torch.Generator().manual_seed(0)
    packed, scales = quantize_mxfp4(torch.randn(257, 1024, generator=g) * 0.05)
    x = torch.randn(8, 1024, generator=g)
    ref = x.double() @ dequantize_mxfp4(packed, scales, torch.float64).T
    for M in (1, 3, 8):
        assert (k.gemv_mxfp4(x[:M], packed, scales).double() - ref[:M]).abs().max() <= 1e-5 * ref.abs().max()


def test_mxfp4_gemv_of_bf16_inputs_equals_the_dequantized_product():
    """bf16 rows (a bf16 model's activations) against the float64 product of the dequantized weights, each result
    rounded to bf16 once, with the extreme scales: rows 0-1 the smallest, row 2 a very large one (on a single 0.5)."""
    g = torch.Generator().manual_seed(2)
    packed, scales = quantize_mxfp4(torch.randn(259, 1024, generator=g) * 0.05)
    scales[0, :], scales[1, :] = 0, 1
    packed[2, :16], packed[2, 0] = 0, 0x01
    scales[2, 0] = 253
    x = torch.randn(8, 1024, generator=g).bfloat16()
    ref = x.double() @ dequantize_mxfp4(packed, scales, torch.float64).T
    for M in (1, 3, 8):
        got = k.gemv_mxfp4(x[:M], packed, scales).double()
        assert torch.isfinite(got).all()
        assert ((got - ref[:M]).abs() <= 2 ** -8 * ref[:M].abs() + 1e-6 * ref[:M].abs().amax(dim=0)).all()


@pytest.mark.parametrize("weights", ["bf16", "bf16 x bf16", "mxfp4", "mxfp4 x bf16"])
def test_a_rows_result_does_not_depend_on_the_batch(weights):
    """Bitwise: decode at batch 8 gives each sequence what it gets alone (for any thread count). bf16 x bf16 products
    of 4 or more rows run on AMX tiles where the CPU has them, which sum in their own order: there a row gets the same
    from any batch of 1-3 rows, and the same from any batch of 4-8."""
    g = torch.Generator().manual_seed(1)
    W = torch.randn(640, 512, generator=g)
    x = torch.randn(8, 512, generator=g)
    if weights.endswith("x bf16"):
        x = x.bfloat16()
    run = (lambda rows: k.gemv_mxfp4(rows, *quantize_mxfp4(W))) if weights.startswith("mxfp4") else \
        (lambda rows: k.gemv(rows, W.bfloat16()))
    together = run(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        if weights == "bf16 x bf16" and k.uses_amx():
            assert torch.equal(torch.cat((run(x[:4]), run(x[4:]))), together)
            assert torch.equal(run(x[2:7]), together[2:7])
            together = run(x[:3])
            assert torch.equal(run(x[:2]), together[:2])
        for i in range(len(together)):
            assert torch.equal(run(x[i:i + 1])[0], together[i])
    finally:
        torch.set_num_threads(threads)


def test_bad_shapes_are_refused():
    with pytest.raises(RuntimeError, match="1..8 rows"):
        k.gemv(torch.randn(9, 64), torch.randn(4, 64))
    with pytest.raises(RuntimeError, match="must be"):
        k.gemv(torch.randn(1, 32), torch.randn(4, 64))
    with pytest.raises(RuntimeError, match="scales must be"):
        k.gemv_mxfp4(torch.randn(1, 64), torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8))


@pytest.mark.parametrize("dtype,gates,head_dim", [("float32", "random", None), ("bfloat16", "random", None),
                                                  ("float32", "extreme", None), ("float32", "random", 136)])
def test_fused_decode_steps_equal_the_op_by_op_step(tiny_dir, tmp_path, dtype, gates, head_dim):
    """KDA and MLA decode kernels (in place on the pool's slots), after prompts prefilled with and without the KDA
    prefill kernels: the same slots and states advanced both ways for a few tokens of a batch of 3 (non-contiguous
    slots, different lengths). "extreme": forget-gate biases from -120 to
    120, so the kernel's vectorized softplus meets its threshold (20), its exponent's clamp (88) and inputs whose e^f
    vanishes next to 1. KDA heads of 136: a state wider than the kernel's 128 columns at a time, and a partial vector
    of channels and columns."""
    from deltaserve import LLM
    from deltaserve.layers.kda import KimiDeltaAttention
    from deltaserve.models.kimi_linear import TINY_CONFIG
    if head_dim is not None:
        tiny_dir = make_tiny(tmp_path / "wide", linear_attn_config={**TINY_CONFIG["linear_attn_config"],
                                                                    "head_dim": head_dim})
    llm = LLM(tiny_dir, dtype=dtype)
    runner, layers = llm.runner, llm.model.model.layers
    mixers = [layer.self_attn for layer in layers]
    if gates == "extreme":
        for mixer in mixers:
            if isinstance(mixer, KimiDeltaAttention):
                mixer.dt_bias.copy_(torch.linspace(-120, 120, mixer.dt_bias.numel()))
    prompts = [list(range(3, 40)), list(range(50, 70)), list(range(100, 160))]
    slots = [0, 5, 2]
    outputs = {}
    for fused in (True, False):
        for mixer in mixers:
            mixer.fused_step = k if fused else None
        for slot, p in zip(slots, prompts):
            runner.reset(slot)
            runner.forward([p], [slot], [0])
        starts = [len(p) for p in prompts]
        steps = []
        for t in range(4):
            steps.append(runner.forward([[7 + t]] * 3, slots, [s + t for s in starts]))
        outputs[fused] = torch.stack(steps)
    tol = 1e-5 if dtype == "float32" else 0.05         # bf16: at most an ulp of a logit near 5
    assert (outputs[True] - outputs[False]).abs().max() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["kimi-linear", "k3"])    # per-head rate, softplus; per-channel rate, lower bound
def test_kda_chunk_inputs_equal_the_op_by_op_ones(dtype, variant):
    """The prefill kernel's chunked q (scaled), k, v, log-decay and beta against layers/kda.py's op-by-op forms, for
    2 sequences of 37 tokens in chunks of 24 (the second padded with zeros), read from views of one projection."""
    import torch.nn.functional as F
    from deltaserve.layers.kda import forget_gate
    from deltaserve.ops.delta_rule import l2norm
    g = torch.Generator().manual_seed(1)
    B, T, H, K, W, C = 2, 37, 3, 32, 4, 24
    P = H * K
    qkv, f, b = torch.randn(B, T, 4 * P + H, generator=g).to(dtype).split([3 * P, P, H], dim=-1)
    window = torch.cat((torch.randn(B, W - 1, 3 * P, generator=g).to(dtype), qkv), dim=1)
    taps, dt_bias = torch.randn(3 * P, W, generator=g) * 0.5, torch.linspace(-30, 30, P)
    per_channel, bound = (True, -5.0) if variant == "k3" else (False, 0.0)
    rate = torch.rand(K if per_channel else H, generator=g) + 0.5
    got = k.kda_chunk_inputs(window, taps.t().contiguous(), f, dt_bias, rate, bound, per_channel, b, K ** -0.5, C)
    conv = F.conv1d(window.transpose(1, 2).float(), taps.unsqueeze(1), groups=3 * P).transpose(1, 2)
    x = F.silu(conv).to(dtype).view(B, T, 3, H, K)
    qk, v = l2norm(x[:, :, :2].float()), x[:, :, 2].float()
    log_decay = forget_gate(f.float().view(B, T, H, K) + dt_bias.view(H, K), rate if per_channel else rate.view(H, 1),
                            bound or None)
    def chunks(t: torch.Tensor) -> torch.Tensor:      # [B, T, H, *] -> [B, H, 2, C, *], zero past T
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, 2 * C - T)).transpose(1, 2)
        return t.reshape(B, H, 2, C, *t.shape[3:])
    want = [chunks(qk[:, :, 0]) * K ** -0.5, chunks(qk[:, :, 1]), chunks(v), chunks(log_decay),
            chunks(torch.sigmoid(b.float()))]
    # bf16: the conv sums in another order than oneDNN's, so a SiLU output can round to the neighbouring bf16
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    for name, a, e in zip(("q", "k", "v", "log-decay", "beta"), got, want):
        assert a.shape == e.shape, name
        assert ((a - e).abs() <= tol * (1 + e.abs())).all(), name


@pytest.mark.parametrize("query_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                     (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("H", [1, 2, 4, 8, 19])   # context tiles of 1, 2, 4, 8, 16 + 1 heads (AVX-512); scores 8 + 1
@pytest.mark.parametrize("rank", [40, 56])   # rank + rope 48 or 64: bf16 x bf16 scores on AMX tiles at multiples of 32
def test_mla_decode_equals_latent_attention(query_dtype, cache_dtype, H, rank):
    """The MLA decode kernel (fold W_UK into the query, write the new latent in place, attend over the slot's own
    length, apply W_UV) vs the op-by-op absorbed attention over the gathered cache, each row to its own length, for
    rows of different lengths in non-contiguous slots."""
    from deltaserve.layers.linear import matmul
    from deltaserve.layers.mla import latent_attention
    from deltaserve.state import StatePool
    from deltaserve.models.spec import StateSpec
    g = torch.Generator().manual_seed(3)
    rope, nope, v, slots, starts = 8, 24, 16, [5, 0, 2], [0, 37, 300]
    pool = StatePool({0: {"latent": StateSpec((rank + rope,), cache_dtype, per_token=True)}}, 6, 400)
    pool.tensors[0, "latent"].copy_(torch.randn(6, 400, rank + rope, generator=g))
    w_kv = (torch.randn(H, nope + v, rank, generator=g) * 0.2).to(query_dtype)        # kv_b_proj, per head
    q = torch.randn(3, H, 1, nope + rope, generator=g).to(query_dtype)
    latent = torch.randn(3, 1, rank + rope, generator=g).to(query_dtype)
    saved = pool.tensors[0, "latent"].clone()
    view = pool.view(slots, starts)
    cache = view.append(0, "latent", latent)
    query = torch.cat((matmul(q[..., :nope], w_kv[:, :nope].float()), q[..., nope:]), dim=-1)
    ctx = latent_attention(query, cache, view.query_positions(1), 0.3, rank)
    ref = matmul(ctx, w_kv[:, nope:].transpose(1, 2).float()).reshape(3, H * v)
    expected_pool = pool.tensors[0, "latent"].clone()
    pool.tensors[0, "latent"].copy_(saved)
    view = pool.view(slots, starts)
    got = k.mla_decode(q[:, :, 0], w_kv[:, :nope].transpose(1, 2).contiguous(), w_kv[:, nope:],
                       pool.tensors[0, "latent"], latent[:, 0].contiguous(), view.slot_ids, view.positions, 0.3)
    assert torch.equal(pool.tensors[0, "latent"], expected_pool)
    assert got.dtype == query_dtype and got.shape == (3, H * v)
    # bf16: an ulp or two of the rounded query, probabilities, context and output
    tol = 1e-5 if query_dtype == torch.float32 else 2 ** -6
    assert (got.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()


def test_decode_kernels_refuse_bad_slots():
    cache = torch.zeros(2, 8, 16)
    q, latent, w_uk, w_uv = torch.zeros(2, 1, 12), torch.zeros(2, 16), torch.zeros(1, 8, 4), torch.zeros(1, 4, 8)
    run = lambda slots, positions: k.mla_decode(q, w_uk, w_uv, cache, latent, torch.tensor(slots),
                                                torch.tensor(positions), 1.0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        run([0, 2], [0, 0])
    with pytest.raises(RuntimeError, match="outside the cache"):
        run([0, 1], [0, 8])
    with pytest.raises(RuntimeError, match="appears twice"):
        run([1, 1], [0, 3])
    assert torch.equal(cache, torch.zeros(2, 8, 16))         # refused before writing anything


@pytest.mark.parametrize("variant", ["bf16", "fp32", "int8", "mxfp4", "situ"])
def test_routed_experts_kernel_equals_the_op_by_op_loop(variant, monkeypatch):
    """1, 3 and 8 tokens (decode batches): the kernel gives the op-by-op loop's result bit for bit."""
    import json
    from pathlib import Path

    from deltaserve.layers.linear import quantize_module_weights
    from deltaserve.layers.moe import MoE
    from deltaserve.models.kimi_linear import TINY_CONFIG, parse_config
    from deltaserve.ops.mxfp4 import quantize_mxfp4
    raw = {**TINY_CONFIG, "moe_intermediate_size": 64, "num_experts_per_token": 4}   # 3+ experts: bf16 sums round
    if variant == "mxfp4":
        raw["quantization_config"] = json.loads((Path(__file__).parent.parent.parent / "shared" / "oracles" /
                                                 "kimi-k3-tiny" / "config.json").read_text())["quantization_config"]
    if variant == "situ":
        raw["hidden_act"] = "situ"
    cfg = parse_config(raw)
    torch.manual_seed(0)
    dtype = torch.float32 if variant == "fp32" else torch.bfloat16
    moe = MoE(cfg, dtype)
    for name, p in moe.named_parameters():
        if p.dtype != torch.uint8:
            p.copy_(torch.randn_like(p.float()) * 0.2)
    if variant == "mxfp4":
        for stacked in ("w13", "w2"):
            dense = torch.randn(getattr(moe, f"{stacked}_packed").shape[:-1] + (getattr(moe, f"{stacked}_packed")
                                                                                .shape[-1] * 2,)) * 0.1
            packed, scales = quantize_mxfp4(dense)
            getattr(moe, f"{stacked}_packed").copy_(packed)
            getattr(moe, f"{stacked}_scale").copy_(scales)
    if variant == "int8":
        quantize_module_weights(moe)
    xs = [torch.randn(n, cfg.hidden_size).to(dtype) for n in (1, 3, 8)]
    fused = [moe(x) for x in xs]
    monkeypatch.setattr("deltaserve.layers.moe.kernels", lambda: None)
    for x, y in zip(xs, fused):
        assert torch.equal(y, moe(x))
