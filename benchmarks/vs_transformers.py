"""Decode and prefill speed of deltaserve vs transformers' native KimiLinearForCausalLM.generate on one checkpoint.

    python benchmarks/vs_transformers.py [CHECKPOINT] --dtype bfloat16 --prompt-tokens 512 --decode-tokens 32
"""
import sys
import time

sys.modules["fla"] = None          # transformers' torch path (fla's kernels need a GPU)

import torch  # noqa: E402

from common import bench_checkpoint, parser, peak_rss_mib  # noqa: E402
from deltaserve import LLM  # noqa: E402
from deltaserve.bench import decode_rate, time_to_first_token  # noqa: E402

parser = parser(__doc__)
parser.add_argument("--prompt-tokens", type=int, default=512)
parser.add_argument("--decode-tokens", type=int, default=32)
args = parser.parse_args()
path = bench_checkpoint(args.checkpoint)
prompt = torch.randint(0, 50000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))

from transformers import KimiLinearForCausalLM  # noqa: E402
ref = KimiLinearForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()


def hf_generate(n: int) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        ref.generate(prompt[None], max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return time.perf_counter() - t0


hf_generate(2)
hf_prefill = hf_generate(1)
hf_decode = args.decode_tokens / (hf_generate(args.decode_tokens + 1) - hf_prefill)
print(f"transformers: prefill {args.prompt_tokens / hf_prefill:.1f} tok/s, decode batch 1 {hf_decode:.2f} tok/s")

llm = LLM(path, dtype=args.dtype, warmup=True)
ttft, _ = time_to_first_token(llm.engine, prompt.tolist())
ours = decode_rate(llm.engine, 1, 32, args.decode_tokens)
print(f"deltaserve:   prefill {args.prompt_tokens / ttft:.1f} tok/s, decode batch 1 {ours:.2f} tok/s "
      f"({ours / hf_decode:.1f}x transformers); peak RSS {peak_rss_mib():.0f} MiB")
