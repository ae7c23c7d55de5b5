"""Quality gates on the shipped default model (trained by scripts/train_default_model.py): bits per character on
held-out Python-documentation prose (tests/data/heldout.txt, pages never trained on), every fast path against its
reference, and greedy generation independent of prefill chunking and prefix reuse."""
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.cli import DEFAULT_MODEL
from deltaserve.convert import convert
from deltaserve.perplexity import evaluate, read_text
from deltaserve.tiny import make_tiny

HELDOUT = Path(__file__).parent / "data" / "heldout.txt"
# Measured on tests/data/heldout.txt (fp32, windows of 4096 tokens): perplexity 74.17, 1.604 bits per character; a
# random model of the same shape 3.30, the random default model this one replaced 6.86. Issue 11's target is 3.0.
BPC_GATE = 1.70
BF16_BOUND = 0.01               # issue 11: bf16 within 1% of fp32 (measured -0.02%)
# Measured +0.026% with MXFP4 routed experts: a broken code table, scale or nibble order moves perplexity by far
# more; the bound leaves room for a different rounding of the same format.
MXFP4_BOUND = 0.001
# Issue 13: every fused / int8 path within 0.5% of its eager reference. Measured: int8 weights -0.005% (prefill) and
# -0.04% (decode); the CPU decode kernels vs PyTorch's ops, decode path: fp32 0.000%, bf16 +0.044%.
FAST_PATH_BOUND = 0.005
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def heldout():
    return read_text(HELDOUT)


@pytest.fixture(scope="module")
def score(heldout):
    """(checkpoint, dtype) -> Perplexity of the held-out text, each computed once per module."""
    cache = {}

    def get(path, dtype):
        key = (str(path), dtype)
        if key not in cache:
            cache[key] = evaluate(LLM(path, dtype=dtype), heldout)
        return cache[key]
    return get


def test_default_model_bits_per_character_on_heldout_prose(score):
    assert score(DEFAULT_MODEL, "float32").bits_per_character <= BPC_GATE


def test_random_model_of_the_same_shape_scores_far_worse(heldout, tmp_path):
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    random_model = make_tiny(tmp_path / "random", **{k: v for k, v in config.items() if k != "dtype"})
    for name in TOKENIZER_FILES:              # the same tokenizer, so both score the same token sequence
        shutil.copy(DEFAULT_MODEL / name, random_model / name)
    sample = heldout[:4000]
    trained, random = (evaluate(LLM(path, dtype="float32"), sample) for path in (DEFAULT_MODEL, random_model))
    assert trained.bits_per_character < 0.6 * random.bits_per_character


def test_bf16_perplexity_within_one_percent_of_fp32(score):
    fp32, bf16 = score(DEFAULT_MODEL, "float32"), score(DEFAULT_MODEL, "bfloat16")
    assert abs(bf16.perplexity / fp32.perplexity - 1) <= BF16_BOUND


def test_mxfp4_experts_perplexity_within_bound_of_bf16_experts(score, tmp_path):
    """Both in fp32 activations, so the difference is the quantization of the routed experts alone."""
    mxfp4 = tmp_path / "mxfp4"
    convert(DEFAULT_MODEL, mxfp4, "mxfp4", progress=False)
    bf16, quantized = score(DEFAULT_MODEL, "float32"), score(mxfp4, "float32")
    assert quantized.nats != bf16.nats                       # the experts really were quantized
    assert abs(quantized.perplexity / bf16.perplexity - 1) <= MXFP4_BOUND


def test_int8_weights_perplexity_within_bound_of_unquantized(heldout, score):
    int8 = evaluate(LLM(DEFAULT_MODEL, dtype="float32", quantization="int8"), heldout)
    assert abs(int8.perplexity / score(DEFAULT_MODEL, "float32").perplexity - 1) <= FAST_PATH_BOUND


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_kernels_perplexity_within_bound_of_pytorch_ops(heldout, dtype):
    """The decode path (one token per forward: fused KDA step, GEMV and expert kernels) against the same path on
    PyTorch's own ops (DELTASERVE_CPU_KERNELS=0, in a fresh process)."""
    from deltaserve.ops.cpu_kernels import kernels
    if kernels() is None:
        pytest.skip("the CPU decode kernels are not available here")
    sample = heldout[:2500]
    fused = evaluate(LLM(DEFAULT_MODEL, dtype=dtype), sample, decode=True)
    code = ("import json, sys; from deltaserve import LLM; from deltaserve.perplexity import evaluate; "
            f"print(evaluate(LLM({str(DEFAULT_MODEL)!r}, dtype={dtype!r}), sys.stdin.read(), decode=True).nats)")
    env = {**__import__("os").environ, "DELTASERVE_CPU_KERNELS": "0"}
    plain = subprocess.run([sys.executable, "-c", code], input=sample, capture_output=True, text=True, env=env,
                           check=True, timeout=300)
    assert abs(math.exp((fused.nats - float(plain.stdout)) / fused.tokens) - 1) <= FAST_PATH_BOUND


def test_windows_predict_every_token_but_the_first_once(heldout):
    text = heldout[:1000]
    whole = LLM(DEFAULT_MODEL, dtype="float32")
    ids = whole.encode(text)
    logits = whole.logits(ids)[:-1]
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()
    one_window = evaluate(whole, text)
    windowed = evaluate(LLM(DEFAULT_MODEL, dtype="float32", max_model_len=64), text)
    assert one_window.tokens == windowed.tokens == len(ids) - 1 and one_window.window == whole.max_model_len
    assert math.isclose(one_window.nats, expected, rel_tol=1e-6)
    assert windowed.nats > one_window.nats                   # less context per prediction costs bits


def test_bench_perplexity_prints_what_the_api_computes(heldout, tmp_path):
    sample = tmp_path / "sample.txt"
    sample.write_text(heldout[:3000], encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "deltaserve", "bench", str(DEFAULT_MODEL), "--perplexity", str(sample),
                        "--dtype", "float32", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    expected = evaluate(LLM(DEFAULT_MODEL, dtype="float32"), heldout[:3000])
    assert json.loads(r.stdout) == pytest.approx(expected.as_dict(), rel=1e-9)


def test_bench_perplexity_of_a_missing_file_is_one_clear_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "deltaserve", "bench", str(DEFAULT_MODEL), "--perplexity",
                        str(tmp_path / "absent.txt")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.startswith(f"deltaserve: error: {tmp_path / 'absent.txt'}: cannot read")


def greedy(llm, prompt, n=12):
    return llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]


# fp32: in bf16, a state reached by decode steps and one reached by chunked prefill round differently, enough to flip
# greedy choices of this small model (the prefix-reuse prompt below diverges at its third token), so exact equality
# is an fp32 property.
def test_greedy_generation_same_for_every_prefill_chunk_size(heldout):
    prompt = LLM(DEFAULT_MODEL).encode(heldout)[:300]
    outputs = {n: greedy(LLM(DEFAULT_MODEL, dtype="float32", prefill_tokens=n), prompt).token_ids
               for n in (64, 128, 512)}
    assert len(set(map(tuple, outputs.values()))) == 1, outputs


def test_prefix_reuse_generates_what_a_fresh_run_does(heldout):
    llm = LLM(DEFAULT_MODEL, dtype="float32")
    first = greedy(llm, heldout[:600])
    follow_up = first.prompt_token_ids + first.token_ids + llm.encode("\n\nThe list type")
    reused = greedy(llm, follow_up)
    fresh = greedy(LLM(DEFAULT_MODEL, dtype="float32"), follow_up)
    assert reused.num_cached_tokens >= len(first.prompt_token_ids) and fresh.num_cached_tokens == 0
    assert reused.token_ids == fresh.token_ids
