"""Decode throughput at batch 8 with and without one json_schema request in the batch, and the compile time of a
20-field schema (and of a tool_choice grammar) through the server's GrammarCompiler.

    python benchmarks/structured_decode.py [CHECKPOINT] [--dtype bfloat16] [--runs 3] [--tokens 48] [--json]

Without a checkpoint it uses the default model (its trained 4,096-id Kimi-layout BPE makes the masks realistic;
the bench preset's vocabulary has Kimi's size but a toy BPE of 480 ranks). Each run decodes `--tokens` tokens for
8 requests: all free, then 7 free + 1 constrained by a schema whose string forces it to stay in the batch; runs
alternate, so a busy machine slows both alike. Decode tok/s counts the 8 rows of every decode step after all are
prefilled.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from grammar_engines import SCHEMA_20  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.cli import DEFAULT_MODEL  # noqa: E402
from deltaserve.engine import Status  # noqa: E402
from deltaserve.structured import Constraint, tool_call_constraint  # noqa: E402

LONG_STRING = {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}},
               "required": ["text"], "additionalProperties": False}


def decode_rate(llm: LLM, tokens: int, constrained: bool) -> float:
    """Tokens per second over the decode steps in which all 8 requests decode."""
    engine = llm.engine
    engine.cache.clear()
    free = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompts = [[(17 * i + j) % 3000 + 10 for j in range(48)] for i in range(8)]
    requests = [engine.add_request(p, free) for p in prompts[:7]]
    grammar = engine.grammar_compiler.compile(Constraint("json", LONG_STRING, "bench")) if constrained else None
    requests.append(engine.add_request(prompts[7], free, grammar=grammar))
    while any(r.status in (Status.WAITING, Status.PREFILL) for r in requests):
        engine.step()
    steps, t0 = 0, time.perf_counter()
    while all(r.status == Status.DECODE for r in requests):
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - t0
    engine.run(requests)
    assert not constrained or requests[7].finish_reason == "length", "the constrained request left the batch early"
    return 8 * steps / elapsed


def compile_times(llm: LLM, repeats: int = 20) -> dict[str, list[float]]:
    compiler = llm.engine.grammar_compiler
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": SCHEMA_20}} for i in range(3)]
    out: dict[str, list[float]] = {"json_schema_20_fields_s": [], "tool_choice_required_3_tools_s": []}
    for _ in range(repeats):
        for key, constraint in (("json_schema_20_fields_s", Constraint("json", SCHEMA_20, "bench")),
                                ("tool_choice_required_3_tools_s", tool_call_constraint(tools, None, llm.tokenizer))):
            t0 = time.perf_counter()
            compiler.compile(constraint)
            out[key].append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", default=str(DEFAULT_MODEL))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    llm = LLM(args.checkpoint, dtype=args.dtype, max_num_seqs=8, warmup=True)
    rates: dict[str, list[float]] = {"free_8": [], "free_7_plus_json_schema_1": []}
    for _ in range(args.runs):
        rates["free_8"].append(decode_rate(llm, args.tokens, constrained=False))
        rates["free_7_plus_json_schema_1"].append(decode_rate(llm, args.tokens, constrained=True))
    result = {"checkpoint": args.checkpoint, "dtype": args.dtype, "vocab": llm.cfg.vocab_size,
              "torch_threads": torch.get_num_threads(), "decode_tok_s": rates, **compile_times(llm)}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name, values in rates.items():
        print(f"decode tok/s, batch 8, {name}: {min(values):.0f}-{max(values):.0f} "
              f"(median {statistics.median(values):.0f}, {len(values)} runs)")
    for name in ("json_schema_20_fields_s", "tool_choice_required_3_tools_s"):
        ms = [1000 * t for t in result[name]]
        print(f"compile {name[:-2]}: {min(ms):.1f}-{max(ms):.1f} ms (median {statistics.median(ms):.1f})")


if __name__ == "__main__":
    main()
