"""Decode throughput at batch 8 with and without batch-invariant mode (`deltaserve serve --batch-invariant`), on the
`bench` preset (hidden 1024, 12 layers, Kimi's 163,840-token vocabulary), modes alternated over several rounds.

    .venv/bin/deltaserve make-tiny /tmp/ds-bench --preset bench
    .venv/bin/python benchmarks/batch_invariant_cost.py /tmp/ds-bench [--dtype bfloat16] [--rounds 3]
"""
import argparse
import json
import statistics

from deltaserve import LLM
from deltaserve.bench import decode_rate

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.batch)
    rates: dict[str, list[float]] = {"batched": [], "batch_invariant": []}
    decode_rate(llm.engine, args.batch, 32, 2)                                  # first calls pay one-time costs
    for _ in range(args.rounds):
        for mode in rates:
            llm.engine.batch_invariant = mode == "batch_invariant"
            rates[mode].append(decode_rate(llm.engine, args.batch, 32, args.steps))
    result = {f"decode_tok_s_batch{args.batch}_{mode}": round(statistics.median(r), 1) for mode, r in rates.items()}
    result["cost"] = round(1 - result[f"decode_tok_s_batch{args.batch}_batch_invariant"] /
                           result[f"decode_tok_s_batch{args.batch}_batched"], 3)
    print(json.dumps({**result, "runs": rates}))
