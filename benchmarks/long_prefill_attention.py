"""One prefill chunk's latent attention (layers/mla.py) at the end of a long context, at Kimi-Linear-48B's MLA
shapes (32 heads, rank 512 + rope 64): ms per chunk and the memory it holds, for a budget of scores held at once
(`SCORES_PER_BLOCK`; a budget past the chunk's scores is the whole chunk as one block).

    python benchmarks/long_prefill_attention.py [--positions 32768] [--budget-log2 26] [--dtype bfloat16]

Run one budget per process: peak RSS only grows.
"""
import time

import torch

from common import peak_rss_mib
from deltaserve.layers import mla

p = __import__("argparse").ArgumentParser(description=__doc__)
p.add_argument("--positions", type=int, default=32768, help="cached positions after the chunk")
p.add_argument("--chunk", type=int, default=512, help="queries (prompt tokens) in the chunk")
p.add_argument("--budget-log2", type=int, default=26, help="scores held at once: 2^this")
p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
p.add_argument("--repeats", type=int, default=3)
args = p.parse_args()

heads, width, rank = 32, 576, 512
dtype = getattr(torch, args.dtype)
torch.manual_seed(0)
query = torch.randn(1, heads, args.chunk, width).to(dtype)
cache = torch.randn(1, args.positions, width).to(dtype)
positions = torch.arange(args.positions - args.chunk, args.positions)[None]
mla.SCORES_PER_BLOCK = 1 << args.budget_log2
before = peak_rss_mib()
times = []
for _ in range(args.repeats):
    start = time.perf_counter()
    mla.latent_attention(query, cache, positions, 0.1, rank)
    times.append(time.perf_counter() - start)
print(f"{args.positions} positions, {args.chunk} queries, budget 2^{args.budget_log2} scores, {args.dtype}: "
      f"{min(times) * 1e3:.0f} ms a chunk ({args.chunk / min(times):.0f} tok/s), "
      f"peak RSS +{peak_rss_mib() - before:.0f} MiB over the inputs")
