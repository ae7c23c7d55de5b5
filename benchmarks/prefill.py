"""Prefill throughput of `LLM.logits` and peak RSS after loading.

    python benchmarks/prefill.py [CHECKPOINT] --dtype bfloat16 --tokens 512
Without CHECKPOINT it uses the bench preset (written to /tmp/deltaserve-bench on first use).
"""
import time

import torch

from common import bench_checkpoint, parser, peak_rss_mib
from deltaserve import LLM

parser = parser(__doc__)
parser.add_argument("--tokens", type=int, default=512)
parser.add_argument("--repeats", type=int, default=3)
args = parser.parse_args()

path = bench_checkpoint(args.checkpoint)
t0 = time.perf_counter()
llm = LLM(path, dtype=args.dtype)
load_s = time.perf_counter() - t0
weights = sum(p.numel() * p.element_size() for p in llm.model.parameters()) / 2**20
print(f"load: {load_s:.2f} s, weights {weights:.0f} MiB, peak RSS after load {peak_rss_mib():.0f} MiB")
ids = torch.randint(0, llm.cfg.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
llm.logits(ids[:64])                                   # first-call allocations
times = []
for _ in range(args.repeats):
    t0 = time.perf_counter()
    llm.logits(ids)
    times.append(time.perf_counter() - t0)
best = min(times)
print(f"prefill {args.tokens} tokens ({args.dtype}, {torch.get_num_threads()} threads): "
      f"{args.tokens / best:.1f} tok/s, {1000 * best / args.tokens:.2f} ms/token (best of {args.repeats}); "
      f"peak RSS {peak_rss_mib():.0f} MiB")
