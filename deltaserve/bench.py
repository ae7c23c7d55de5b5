"""`deltaserve bench`: load time, prefill and decode throughput, time to first token cold vs with prefix reuse,
peak RSS. Decode rates are steady-state engine steps, measured after warmup."""
from __future__ import annotations

import resource
import time
from typing import Any

import torch

from .engine import Engine, Status
from .sampling import SamplingParams


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, min(vocab, 50000), (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def time_to_first_token(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """(seconds until the first sampled token, tokens restored from the prefix cache)."""
    r = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    engine.run([r])
    return r.first_token_at - t0, r.num_cached_tokens


def decode_rate(engine: Engine, batch: int, prompt_tokens: int, steps: int) -> float:
    """Aggregate tokens/s of `steps` decode steps with `batch` sequences generating together."""
    vocab = engine.cfg.vocab_size
    params = SamplingParams(max_tokens=steps + batch + 2, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(_prompt(prompt_tokens, 100 + i, vocab), params) for i in range(batch)]
    while any(r.status != Status.DECODE for r in reqs):
        failed = [r for r in reqs if r.status == Status.FINISHED]
        if failed:                   # e.g. a request failed alone (engine fault isolation): say so, do not spin
            raise RuntimeError(f"bench request {failed[0].id} ended before decoding: {failed[0].finish_reason}")
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    for r in reqs:
        engine.abort(r.id)
    engine.step()
    return batch * steps / elapsed


def read_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Bytes per second the device reads from its memory (a CPU with torch's threads): the best of a few sums over a
    buffer larger than any cache. Weights that partly stay in a large last-level cache between steps (bench-s's 190 MB
    in bf16 against a 480 MB L3) decode in less than the roofline's time: a ratio below 1."""
    buf = torch.ones(nbytes // 4, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(repeats + 1):            # the first sum on a GPU also loads its kernel
        sync()
        t0 = time.perf_counter()
        buf.sum()
        sync()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def run_bench(llm: Any, load_s: float, prompt_tokens: int, decode_tokens: int, batch: int = 8) -> dict[str, float]:
    engine: Engine = llm.engine
    vocab = llm.cfg.vocab_size
    engine.cache.clear()
    prompt = _prompt(prompt_tokens, 0, vocab)
    ttft_cold, _ = time_to_first_token(engine, prompt)
    # a second turn: the first turn's prompt + its reply + a new user message
    first = engine.add_request(prompt, SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True))
    engine.run([first])
    follow_up = first.tokens + _prompt(32, 1, vocab)
    ttft_reuse, cached = time_to_first_token(engine, follow_up)
    engine.cache.clear()
    ttft_recompute, _ = time_to_first_token(engine, follow_up)
    engine.cache.clear()
    decode1 = decode_rate(engine, 1, 32, decode_tokens)
    bytes_per_token, bytes_per_batch = (llm.model.weight_bytes_per_step(b) for b in (1, batch))
    bandwidth = read_bandwidth(engine.device)
    decode_batch = decode_rate(engine, batch, 32, decode_tokens)
    return {
        "load_s": load_s,
        "prompt_tokens": prompt_tokens,
        "prefill_tok_s": prompt_tokens / ttft_cold,
        "ttft_cold_s": ttft_cold,
        "second_turn_tokens": len(follow_up),
        "second_turn_cached_tokens": cached,
        "ttft_second_turn_reuse_s": ttft_reuse,
        "ttft_second_turn_recompute_s": ttft_recompute,
        "decode_tok_s_batch1": decode1,
        "weight_bytes_per_token": round(bytes_per_token),
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "roofline_decode_tok_s": bandwidth / bytes_per_token,
        "decode_vs_roofline": bandwidth / bytes_per_token / decode1,
        f"decode_tok_s_batch{batch}": decode_batch,
        # a batch's tokens route to more experts than one token does: its roofline is not batch x batch 1's
        f"weight_bytes_per_step_batch{batch}": round(bytes_per_batch),
        f"roofline_decode_tok_s_batch{batch}": batch * bandwidth / bytes_per_batch,
        f"decode_batch{batch}_vs_roofline": batch * bandwidth / bytes_per_batch / decode_batch,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def format_bench(r: dict[str, float]) -> str:
    batch = next(k for k in r if k.startswith("decode_tok_s_batch") and k != "decode_tok_s_batch1")[len("decode_tok_s_"):]
    n = batch[len("batch"):]
    return "\n".join([
        f"load:                {r['load_s']:.2f} s",
        f"prefill:             {r['prefill_tok_s']:.1f} tok/s ({r['prompt_tokens']} tokens, TTFT {r['ttft_cold_s'] * 1000:.0f} ms)",
        f"decode batch 1:      {r['decode_tok_s_batch1']:.1f} tok/s ({1000 / r['decode_tok_s_batch1']:.1f} ms/token)",
        f"{f'decode batch {n}:':<20} {r['decode_tok_s_' + batch]:.1f} tok/s aggregate",
        f"roofline batch 1:    {r['roofline_decode_tok_s']:.1f} tok/s ({r['weight_bytes_per_token'] / 1e6:.1f} MB of "
        f"weights per token at {r['read_bandwidth_gb_s']:.1f} GB/s read); decode takes {r['decode_vs_roofline']:.2f}x "
        "its time",
        f"{f'roofline batch {n}:':<20} {r['roofline_decode_tok_s_' + batch]:.1f} tok/s aggregate "
        f"({r['weight_bytes_per_step_' + batch] / 1e6:.1f} MB a step with the experts its tokens route to, uniformly); "
        f"decode takes {r[f'decode_{batch}_vs_roofline']:.2f}x its time",
        f"second turn TTFT:    {r['ttft_second_turn_reuse_s'] * 1000:.0f} ms reusing {r['second_turn_cached_tokens']} of "
        f"{r['second_turn_tokens']} tokens vs {r['ttft_second_turn_recompute_s'] * 1000:.0f} ms recomputed "
        f"({r['ttft_second_turn_recompute_s'] / r['ttft_second_turn_reuse_s']:.1f}x)",
        f"peak RSS:            {r['peak_rss_mib']:.0f} MiB",
    ])
