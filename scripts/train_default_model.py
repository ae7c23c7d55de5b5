"""Train the embedded default model: a small Kimi Linear (KDA + NoPE MLA + MoE with a shared expert, dense first
layer) on the Python documentation, with transformers' native KimiLinearForCausalLM in plain PyTorch.

    apt-get install -y python3.11-doc
    .venv/bin/python scripts/prepare_corpus.py /tmp/deltaserve-corpus
    nice -n 10 .venv/bin/python scripts/train_default_model.py /tmp/deltaserve-corpus deltaserve/default_model

Fixed seed, AdamW, warmup + cosine schedule, loss logged. The weights are written in the official Kimi Linear layout
(the names, dtypes and shards of `deltaserve make-tiny`), then loaded by deltaserve and by transformers, whose
logits must agree (max |dlogit| <= 1e-4 in fp32) before the script reports success.
"""
from __future__ import annotations

import os

# On a shared machine, OpenMP threads that spin while waiting for a busy core burn the time they wait for.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

sys.modules["fla"] = None        # keep transformers on its pure-torch KDA path (fla's kernels are GPU-only)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from deltaserve.checkpoint import INDEX, SAFETENSORS_DTYPES  # noqa: E402
from deltaserve.tiny import make_tiny  # noqa: E402
from deltaserve.tokenizer import Tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from prepare_corpus import VOCAB_SIZE  # noqa: E402

# config.json fields over deltaserve.tiny.TINY_CONFIG: hidden 192, five layers in Kimi Linear's 3:1 KDA:MLA pattern
# (MLA is layer 4), KDA heads of 64, 8 routed experts (top 2) of 64 plus one shared, about 4.0M parameters (8 MB bf16).
MODEL_CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=192, intermediate_size=384, moe_intermediate_size=64, num_hidden_layers=5,
    num_attention_heads=3, num_key_value_heads=3, head_dim=48, kv_lora_rank=96, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32,
    linear_attn_config={"full_attn_layers": [4], "kda_layers": [1, 2, 3, 5], "head_dim": 64, "num_heads": 3,
                        "short_conv_kernel_size": 4},
    bos_token_id=VOCAB_SIZE - 256, eos_token_id=VOCAB_SIZE - 254, pad_token_id=VOCAB_SIZE - 1,
)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_kda_for_training(query, key, value, g, beta, chunk_size=8, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' chunk_kimi_delta_attention restructured for autograd on CPU, same formulas: the intra-chunk
    inverse (I + strictly-lower(A_kk))^-1 by one triangular solve instead of a row loop of in-place writes, and chunk
    outputs stacked instead of written into slices (each slice write costs a full-size zero gradient). Short chunks
    keep the pairwise [C, C, K] decay tensors small. `check_kda_matches_transformers` compares the two."""
    dtype = query.dtype
    q, k, v, beta, g = (x.transpose(1, 2).float() for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    b, h, t, dk = k.shape
    c = chunk_size
    pad = (-t) % c
    q = F.pad(q, (0, 0, 0, pad)) * dk ** -0.5
    k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (k, v, g))
    q, k, v, g = (x.reshape(b, h, -1, c, x.shape[-1]) for x in (q, k, v, g))
    beta = F.pad(beta, (0, pad)).reshape(b, h, -1, c, 1)
    g = g.cumsum(-2)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(~causal[..., None], float("-inf")).exp()
    k_beta = k * beta
    a_kk = (k_beta.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1).tril(-1)
    a_qk = (q.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1)
    eye = torch.eye(c, device=q.device)
    w = torch.linalg.solve_triangular(eye + a_kk, eye.expand_as(a_kk), upper=False, unitriangular=True)
    u, k_cumdecay = w @ (v * beta), w @ (k_beta * g.exp())
    state = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.float()
    outs = []
    for n in range(q.shape[2]):
        g_n = g[:, :, n]
        v_new = u[:, :, n] - k_cumdecay[:, :, n] @ state
        outs.append((q[:, :, n] * g_n.exp()) @ state + a_qk[:, :, n] @ v_new)
        state = (state * g_n[:, :, -1:].exp().transpose(-1, -2)
                 + (k[:, :, n] * (g_n[:, :, -1:] - g_n).exp()).transpose(-1, -2) @ v_new)
    out = torch.stack(outs, 2).reshape(b, h, -1, v.shape[-1])[:, :, :t]
    return out.transpose(1, 2).contiguous().to(dtype), (state if output_final_state else None)


def check_kda_matches_transformers(reference) -> None:
    """Outputs, final state and input gradients of chunk_kda_for_training equal transformers' own function."""
    gen = torch.Generator().manual_seed(0)
    shape = (2, 100, 3, 16)
    inputs = [torch.randn(shape, generator=gen) for _ in range(3)]
    inputs += [-2 * torch.rand(shape, generator=gen), torch.rand(shape[:3], generator=gen)]
    state0, weight = torch.randn(2, 3, 16, 16, generator=gen), torch.randn(shape, generator=gen)
    results = []
    for fn in (reference, chunk_kda_for_training):
        xs = [x.clone().requires_grad_() for x in inputs]
        out, state = fn(*xs, initial_state=state0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        (out * weight).sum().backward()
        results.append([out, state] + [x.grad for x in xs])
    err = max((a - b).abs().max().item() for a, b in zip(*results))
    if err > 1e-4:
        raise SystemExit(f"chunk_kda_for_training differs from transformers' KDA by {err:.2e}")


class ExpertBalancer:
    """Auxiliary-loss-free load balancing (DeepSeek-V3, used by Kimi): after each step, raise the selection bias
    (e_score_correction_bias) of under-loaded experts and lower it for over-loaded ones by a fixed rate."""

    def __init__(self, model: torch.nn.Module, rate: float):
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter
        self.routers = [m for m in model.modules() if isinstance(m, KimiLinearTopkRouter)]
        self.counts = [torch.zeros(r.num_experts) for r in self.routers]
        self.rate = rate
        for router, count in zip(self.routers, self.counts):
            router.register_forward_hook(functools.partial(self._count, count))

    @staticmethod
    def _count(count: torch.Tensor, module, inputs, output) -> None:
        if module.training:
            count += torch.bincount(output[2].flatten(), minlength=count.numel()).float()

    def step(self) -> float:
        """Apply the update; returns the busiest expert's share of tokens over the ideal share (1.0 = balanced)."""
        worst = 0.0
        with torch.no_grad():
            for router, count in zip(self.routers, self.counts):
                worst = max(worst, (count.max() / count.mean()).item())
                router.e_score_correction_bias += self.rate * torch.sign(count.mean() - count)
                count.zero_()
        return worst


def batches(tokens: torch.Tensor, seq_len: int, batch: int, seed: int) -> Iterator[torch.Tensor]:
    """[batch, seq_len + 1] windows: every epoch visits the non-overlapping windows in a fresh seeded order."""
    starts = torch.arange(0, len(tokens) - seq_len - 1, seq_len)
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = starts[torch.randperm(len(starts), generator=gen)]
        for i in range(0, len(order) - batch + 1, batch):
            yield torch.stack([tokens[s:s + seq_len + 1] for s in order[i:i + batch].tolist()])


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, ids: list[int], window: int) -> float:
    """Mean nats per predicted token over consecutive windows that overlap by one token (each token is predicted
    once, from a fresh state at each window start)."""
    total, count = 0.0, 0
    model.eval()
    for start in range(0, len(ids) - 1, window - 1):
        chunk = torch.tensor([ids[start:start + window]])
        logits = model(input_ids=chunk).logits[0, :-1].float()
        total += F.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    model.train()
    return total / count


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: torch.nn.Module, tokens: torch.Tensor, heldout: list[int], args: argparse.Namespace) -> float:
    """Returns the mean training loss of the last 20 steps."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    balancer = ExpertBalancer(model, args.balance_rate)
    data = batches(tokens, args.seq_len, args.batch, args.seed)
    recent: list[float] = []
    t0 = time.perf_counter()
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        x = next(data)
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        imbalance = balancer.step()
        recent = (recent + [loss.item()])[-20:]
        if step % 10 == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - t0
            print(f"step {step:4d}  loss {loss.item():.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                  f"expert load max/mean {imbalance:.2f}  {(step + 1) * x[:, 1:].numel() / elapsed:.0f} tok/s  "
                  f"{elapsed / 60:.1f} min", flush=True)
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            nats = heldout_loss(model, heldout, args.seq_len)
            print(f"held-out: {nats:.4f} nats/token, perplexity {math.exp(nats):.2f}", flush=True)
    return sum(recent) / len(recent)


def export(model: torch.nn.Module, dst: Path) -> None:
    """Overwrite the tensors of the official-layout checkpoint in `dst` (written by make_tiny) with the trained
    ones: transformers' save_pretrained gives the official names except for dense layers, which it writes under
    block_sparse_moe; each tensor keeps the dtype of the official layout (bf16, or fp32 for the four fp32 kinds)."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        trained = {}
        for file in Path(tmp).glob("*.safetensors"):
            with safe_open(file, "pt") as f:
                trained.update({n: f.get_tensor(n) for n in f.keys()})
    dense = model.config.first_k_dense_replace
    is_dense = lambda n: n.startswith("model.layers.") and int(n.split(".")[2]) < dense
    trained = {n.replace(".block_sparse_moe.", ".mlp.") if is_dense(n) else n: t for n, t in trained.items()}
    weight_map = json.loads((dst / INDEX).read_text())["weight_map"]
    if set(weight_map) != set(trained):
        raise SystemExit(f"names differ from the official layout: {sorted(set(weight_map) ^ set(trained))[:8]}")
    for file in sorted(set(weight_map.values())):
        with safe_open(dst / file, "pt") as f:
            layout = {n: f.get_slice(n) for n in f.keys()}
            out = {n: trained[n].to(SAFETENSORS_DTYPES[s.get_dtype()]) for n, s in layout.items()}
            if any(tuple(layout[n].get_shape()) != tuple(t.shape) for n, t in out.items()):
                raise SystemExit(f"{file}: a trained tensor's shape differs from the official layout")
        save_file({n: t.contiguous() for n, t in out.items()}, dst / file, metadata={"format": "pt"})


def verify(dst: Path, ids: list[int]) -> float:
    """max |dlogit| between deltaserve and transformers on the written checkpoint (fp32), after transformers has
    consumed every tensor of it."""
    from transformers import KimiLinearForCausalLM

    from deltaserve import LLM
    ref, info = KimiLinearForCausalLM.from_pretrained(dst, dtype=torch.float32, output_loading_info=True)
    if any(info.values()):
        raise SystemExit(f"transformers did not load the checkpoint cleanly: {info}")
    with torch.no_grad():
        expected = ref.eval()(torch.tensor([ids])).logits[0]
    return (LLM(dst, dtype="float32").logits(ids) - expected).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus", type=Path, help="output directory of scripts/prepare_corpus.py")
    ap.add_argument("dst", type=Path, help="where the checkpoint is written (its model and tokenizer files)")
    ap.add_argument("--steps", type=int, default=480)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--balance-rate", type=float, default=1e-2, help="expert bias update per step")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers.models.kimi_linear.modeling_kimi_linear as hf_kimi
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    check_kda_matches_transformers(hf_kimi.chunk_kimi_delta_attention)

    tokenizer_dir = args.corpus / "tokenizer"
    tokenizer = Tokenizer(tokenizer_dir)
    tokens = torch.tensor(tokenizer.encode((args.corpus / "train.txt").read_text(encoding="utf-8")))
    heldout = tokenizer.encode((args.corpus / "heldout.txt").read_text(encoding="utf-8"))
    print(f"{len(tokens):,} training tokens, {len(heldout):,} held-out tokens", flush=True)

    make_tiny(args.dst, seed=args.seed, **MODEL_CONFIG)          # the official layout, filled below
    for name in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
        (args.dst / name).write_bytes((tokenizer_dir / name).read_bytes())
    torch.manual_seed(args.seed)
    model = KimiLinearForCausalLM(KimiLinearConfig.from_pretrained(args.dst)).float()
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters", flush=True)

    reference_kda = hf_kimi.chunk_kimi_delta_attention
    hf_kimi.chunk_kimi_delta_attention = chunk_kda_for_training
    t0 = time.perf_counter()
    try:
        final = train(model, tokens, heldout, args)
    finally:
        hf_kimi.chunk_kimi_delta_attention = reference_kda
    print(f"trained {args.steps} steps in {(time.perf_counter() - t0) / 60:.1f} min; "
          f"final train loss (last 20 steps) {final:.4f}", flush=True)
    export(model, args.dst)
    err = verify(args.dst, heldout[:300])
    print(f"deltaserve vs transformers on {args.dst}: max |dlogit| {err:.2e}", flush=True)
    if err > 1e-4:
        raise SystemExit("deltaserve and transformers disagree on the trained checkpoint")


if __name__ == "__main__":
    main()
