"""MXFP4 vs the original checkpoint: resident weight bytes, top-1 agreement of greedy logits, decode speed.

    python benchmarks/mxfp4.py ORIGINAL CONVERTED --dtype bfloat16
(make CONVERTED with `deltaserve convert ORIGINAL CONVERTED --experts mxfp4`). Each model runs in turn.
"""
import gc

import torch

from common import parser, peak_rss_mib
from deltaserve import LLM
from deltaserve.bench import decode_rate

parser = parser(__doc__)
parser.add_argument("converted")
parser.add_argument("--tokens", type=int, default=256)
args = parser.parse_args()
ids = torch.randint(0, 50000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
results = {}
runs = (("original", args.checkpoint, args.dtype), ("mxfp4", args.converted, args.dtype),
        ("original float32", args.checkpoint, "float32"))
for label, path, dtype in runs:
    llm = LLM(path, dtype=dtype, warmup=True)
    experts = sum(p.numel() * p.element_size() for n, p in llm.model.named_parameters()
                  if n.split(".")[-1] in ("w13", "w2", "w13_packed", "w13_scale", "w2_packed", "w2_scale"))
    weights = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    logits = llm.logits(ids)
    rate = decode_rate(llm.engine, 1, 32, 32)
    results[label] = logits
    print(f"{label:>8}: weights {weights / 2**20:.0f} MiB (routed experts {experts / 2**20:.0f} MiB), "
          f"decode batch 1 {rate:.1f} tok/s, peak RSS so far {peak_rss_mib():.0f} MiB")
    del llm
    gc.collect()
agree = lambda a, b: (results[a].argmax(-1) == results[b].argmax(-1)).float().mean().item()
corr = lambda a, b: torch.corrcoef(torch.stack([results[a].flatten(), results[b].flatten()]))[0, 1].item()
print(f"top-1 agreement over {args.tokens} positions: mxfp4 vs original {agree('mxfp4', 'original'):.3f} "
      f"(logit correlation {corr('mxfp4', 'original'):.3f}); yardstick, the original in {args.dtype} vs float32: "
      f"{agree('original', 'original float32'):.3f} (correlation {corr('original', 'original float32'):.3f})")
