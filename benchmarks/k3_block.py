"""One exact-width Kimi K3 block with fake weights: 7168 residual, KDA with 96 heads of 128x128 states (full-rank
bounded gate), latent MoE (3584 wide, top-16 of 896 MXFP4 experts of 3072, 2 shared experts), Block Attention
Residual scoring over `--archived` earlier block sums. Times a decode step and a prefill chunk, prints ms/block
and the tok/s projected over K3's 93 blocks (as the seed's fake-weight harness does).

    python benchmarks/k3_block.py [--dtype bfloat16] [--chunk 128] [--repeats 5] [--resident-experts 64]

896 MXFP4 experts take 15.7 GB; the expert tensors are allocated lazily and only the first --resident-experts are
written (and so resident). The router stays 896 wide; its correction bias steers top-16 into the resident ones.
"""
import json
import statistics
import time
from pathlib import Path

import torch

from common import peak_rss_mib
from deltaserve.distributed import TP
from deltaserve.models.kimi_k3 import parse_config
from deltaserve.models.kimi_linear import DecoderLayer
from deltaserve.state import StatePool

p = __import__("argparse").ArgumentParser(description=__doc__)
p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
p.add_argument("--chunk", type=int, default=128, help="prefill chunk (tokens)")
p.add_argument("--repeats", type=int, default=5)
p.add_argument("--resident-experts", type=int, default=64)
p.add_argument("--archived", type=int, default=4, help="archived block sums the residual mixtures score")
args = p.parse_args()

dtype = getattr(torch, args.dtype)
cfg = parse_config(json.loads((Path(__file__).parent / "kimi-k3" / "config.json").read_text()))
torch.manual_seed(0)
t0 = time.perf_counter()
block = DecoderLayer(cfg, 1, dtype, TP(), chunk_size=64)            # layer 1: KDA + latent MoE
moe, n = block.block_sparse_moe, args.resident_experts
with torch.no_grad():
    for name, param in block.named_parameters():
        if "_packed" in name:                                         # random E2M1 codes for the resident experts
            param[:n] = torch.randint(0, 256, param[:n].shape, dtype=torch.uint8)
        elif "_scale" in name:                                        # scales around 2^-5
            param[:n] = torch.randint(120, 125, param[:n].shape, dtype=torch.uint8)
        elif name.endswith(("A_log", "e_score_correction_bias", "dt_bias")):
            param.copy_(torch.rand(param.shape))
        else:
            param.copy_(torch.randn(param.shape) / param.shape[-1] ** 0.5 if param.dim() > 1 else 1 + 0.1 * torch.randn(param.shape))
    moe.e_score_correction_bias[n:] = -10.0                          # route into the resident experts only
for module in block.modules():
    if hasattr(module, "finalize"):
        module.finalize()
print(f"built in {time.perf_counter() - t0:.1f} s; peak RSS {peak_rss_mib():.0f} MiB; {torch.get_num_threads()} threads")

pool = StatePool({1: block.self_attn.state_spec()}, 1, args.chunk + args.repeats + 4)
D = cfg.hidden_size


def run(T: int, start: int) -> float:
    x = torch.randn(1, T, D).to(dtype)
    archived = [torch.randn(1, T, D).to(dtype) for _ in range(args.archived)]
    t = time.perf_counter()
    with torch.inference_mode():
        block(x, archived, pool.view([0], [start]))
    return time.perf_counter() - t


run(args.chunk, 0)                                                    # first-call allocations
prefill = statistics.median(run(args.chunk, 0) for _ in range(args.repeats))
run(1, args.chunk)
decode = statistics.median(run(1, args.chunk) for _ in range(args.repeats))
print(f"decode:  {decode * 1000:8.2f} ms/block -> {1 / (93 * decode):7.2f} tok/s projected over 93 blocks")
print(f"prefill: {prefill * 1000:8.2f} ms/block for {args.chunk} tokens -> "
      f"{args.chunk / (93 * prefill):7.1f} tok/s projected over 93 blocks")
print(f"peak RSS {peak_rss_mib():.0f} MiB ({args.dtype}; the seed: 1.367 ms/block decode on MI350X TP8)")
