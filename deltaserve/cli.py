"""The `deltaserve` command."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

DEFAULT_MODEL = Path(__file__).parent / "default_model"
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)             # torch.Generator's; sampling.py has the same (no torch here)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        """One line, no usage block: the message names the flag and what it takes."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or high is not None and value > high:
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"{value} is out of range: it must be {bounds}")
        return value
    return parse


def number(low: float, high: float = math.inf, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] (or (low, high])."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < low or value == low and low_open or value > high:
            bounds = ("> " if low_open else ">= ") + f"{low:g}" + ("" if high == math.inf else f" and <= {high:g}")
            raise argparse.ArgumentTypeError(f"{text} is out of range: it must be {bounds}")
        return value
    return parse


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def device(text: str) -> str:
    if text != "cpu":
        import torch
        try:
            torch.device(text)
        except RuntimeError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    return text


def add_model_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    if optional:
        p.add_argument("model", nargs="?", default=str(DEFAULT_MODEL),
                       help="checkpoint directory (default: the small trained model shipped in the package)")
    else:
        p.add_argument("model", help="checkpoint directory (official Hugging Face layout)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", type=device, default="cpu")
    p.add_argument("--max-model-len", type=integer(2), default=None)
    p.add_argument("--chunk-size", type=integer(1), default=64, help="delta-rule chunk (tokens); part of the numerics")
    p.add_argument("--max-num-seqs", type=integer(1), default=8, help="sequences decoded together")
    p.add_argument("--prefix-cache-bytes", type=integer(0), default=1 << 30)
    p.add_argument("--hf-overrides", type=json_object, default=None, help="JSON merged into config.json")
    p.add_argument("--quantization", choices=["int8"], default=None,
                   help="int8: weight-only int8 projections and experts, one scale per 32 inputs (llama.cpp's Q8_0)")
    p.add_argument("--tensor-parallel-size", type=integer(1), default=1,
                   help="ranks (processes) sharing the model; gloo on CPU, NCCL on CUDA; torchrun for several hosts")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run eagerly (by default a CPU compiles the decode step with torch.compile "
                        "during warmup; compiled graphs are cached under ~/.cache/deltaserve/inductor/<vector ISA>)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="decode one sequence per forward, so a sequence's logits never depend on what else is "
                        "batched (bf16 included); costs decode throughput")


def load_llm(args: argparse.Namespace, warmup: bool = False, one_shot: bool = False):
    """`one_shot`: a command that runs one request or one pass (generate, perplexity) runs eagerly, since compiling
    would take longer than the work."""
    from .llm import LLM
    return LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
               chunk_size=args.chunk_size, hf_overrides=args.hf_overrides, max_num_seqs=args.max_num_seqs,
               prefix_cache_bytes=args.prefix_cache_bytes, warmup=warmup,
               tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
               batch_invariant=args.batch_invariant, enforce_eager=one_shot or args.enforce_eager or None)


class GenerationFailed(RuntimeError):
    """A request failed in the engine (its error says why); the others, and the model, go on."""


def stream(llm, prompt: list[int], params) -> tuple[list[int], str, dict[str, float]]:
    """Generate, printing text as it comes; returns the tokens, text and timing stats."""
    engine = llm.engine
    r = engine.add_request(prompt, params)
    t0 = time.perf_counter()
    while r.finish_reason is None:
        for u in engine.step():
            if u.request is r and u.text:
                print(u.text, end="", flush=True)
    if r.finish_reason == "error":
        raise GenerationFailed(f"generation failed: {r.error}")
    prefill_s = r.first_token_at - t0
    decode_s = r.finished_at - r.first_token_at
    stats = {"cached": r.num_cached_tokens, "new": len(prompt) - r.num_cached_tokens,
             "prefill_tok_s": (len(prompt) - r.num_cached_tokens) / prefill_s if prefill_s > 0 else 0.0,
             "decode_tok_s": (len(r.output) - 1) / decode_s if decode_s > 0 and len(r.output) > 1 else 0.0,
             "out": len(r.output)}
    return r.output, r.text, stats


def cmd_generate(args: argparse.Namespace) -> None:
    from .sampling import SamplingParams
    llm = load_llm(args, one_shot=True)
    chat = [{"role": "user", "content": args.prompt}]
    prompt = llm.template.render_ids(llm.tokenizer, chat) if args.chat else llm.encode(args.prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    stream(llm, prompt, params)
    print()


def cmd_chat(args: argparse.Namespace) -> None:
    from .sampling import SamplingParams
    llm = load_llm(args, warmup=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("deltaserve chat: type a message, Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        prompt = llm.template.render_ids(llm.tokenizer, messages)
        try:
            _, text, s = stream(llm, prompt, params)
        except GenerationFailed as e:               # that reply is lost; the conversation goes on without it
            print(f"\ndeltaserve: error: {e}", file=sys.stderr)
            messages.pop()
            continue
        print()
        print(f"[in: {s['cached']} cached + {s['new']} new, prefill {s['prefill_tok_s']:.0f} tok/s, "
              f"decode {s['decode_tok_s']:.0f} tok/s, out: {s['out']}]", file=sys.stderr)
        messages.append({"role": "assistant", "content": text})


def cmd_serve(args: argparse.Namespace) -> None:
    import ipaddress

    from .serving import ConnectionLimits, ListenError, bind, connection_capacity, serve
    capacity = connection_capacity()
    max_connections = min(1024, capacity) if args.max_connections is None else args.max_connections
    if max_connections > capacity:
        raise ValueError(f"--max-connections {max_connections}: the open-file limit (ulimit -n) leaves room for "
                         f"{capacity}; raise the limit or lower the flag")
    try:
        sock = bind(args.host, args.port)
    except ListenError as e:
        raise ValueError(str(e)) from None
    address, port = sock.getsockname()[:2]
    from .guard import LOOPBACK_NAMES, RequestLimits      # after binding: these import torch, which takes seconds
    from .server import ServerState, create_app, start_engine, stop_admitting, stop_engine
    allowed = {h.strip().lower() for h in args.allowed_hosts.split(",") if h.strip()} if args.allowed_hosts else set()
    if "*" in allowed or not (allowed or ipaddress.ip_address(address).is_loopback):
        hosts = None                       # any Host: a public bind (or '*') is the operator's explicit choice
    else:
        hosts = frozenset(allowed | LOOPBACK_NAMES | {args.host.lower(), address})
    default = Path(args.model).resolve() == DEFAULT_MODEL.resolve()
    name = args.served_model_name or ("deltaserve-default" if default else Path(args.model).resolve().name)
    from .sampling import generation_defaults
    folder = {"auto": args.model, "vllm": None}.get(args.generation_config, args.generation_config)
    if folder is not None and folder != args.model and not (Path(folder) / "generation_config.json").exists():
        raise ValueError(f"--generation-config {folder}: there is no generation_config.json in it")
    defaults = generation_defaults(folder) if folder is not None else {}
    state = ServerState(name, args.max_queued_requests, tuple(args.api_key or ()),
                        RequestLimits(args.max_request_bytes, args.body_timeout, hosts), args.reasoning_parser,
                        defaults)

    def fatal(e: BaseException) -> None:   # a bad checkpoint or config: say why and stop the whole server
        print(f"deltaserve: error: {e}", file=sys.stderr, flush=True)
        os._exit(2)

    start_engine(state, lambda: load_llm(args), fatal)
    shown = f"[{address}]" if ":" in address else address
    print(f"deltaserve: serving '{name}' on http://{shown}:{port} (/health is 503 until warm)",
          file=sys.stderr, flush=True)
    limits = ConnectionLimits(args.header_timeout, args.keep_alive_timeout, max_connections)
    serve(create_app(state), sock, limits, args.shutdown_timeout + 5,
          lambda signal_name: stop_admitting(state, signal_name, args.shutdown_timeout), state.log)
    if not stop_engine(state):             # still loading the model: nothing to finish, leave at once
        print("deltaserve: stopped", file=sys.stderr, flush=True)
        os._exit(0)
    print("deltaserve: stopped", file=sys.stderr, flush=True)


def cmd_bench(args: argparse.Namespace) -> None:
    if args.perplexity:             # quality instead of speed: the text scored through the engine's prefill path
        from .perplexity import evaluate, format_perplexity, read_text
        text = read_text(args.perplexity)
        p = evaluate(load_llm(args, one_shot=True), text)
        print(json.dumps(p.as_dict(), indent=2) if args.json else format_perplexity(p))
        return
    from .bench import format_bench, run_bench
    t0 = time.perf_counter()
    llm = load_llm(args, warmup=True)
    result = run_bench(llm, time.perf_counter() - t0, args.prompt_tokens, args.decode_tokens, args.batch)
    print(json.dumps(result, indent=2) if args.json else format_bench(result))


def cmd_inspect(args: argparse.Namespace) -> None:
    from .audit import audit, format_report
    report = audit(args.model, args.context, args.tp, args.metadata_only, args.device_memory, args.max_num_seqs,
                   None if args.dtype == "auto" else args.dtype)
    print(json.dumps(report, indent=2) if args.json else format_report(report))


def cmd_convert(args: argparse.Namespace) -> None:
    from .convert import convert
    t0 = time.perf_counter()
    stats = convert(args.src, args.dst, args.experts, args.force)
    print(f"converted {args.src} -> {args.dst} in {time.perf_counter() - t0:.1f}s: "
          f"{stats['source_bytes']:,} -> {stats['converted_bytes']:,} bytes of tensors")


def cmd_make_tiny(args: argparse.Namespace) -> None:
    from .tiny import make_tiny
    path = make_tiny(args.dst, seed=args.seed, dtype=args.dtype, preset=args.preset,
                     shards=4 if args.preset == "bench" else 2)
    print(f"wrote a random Kimi Linear checkpoint to {path}")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="deltaserve", description="Serve hybrid linear-attention LLMs (Kimi Linear).")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_model_args(p, optional=True)
    p.add_argument("--host", type=nonempty, default="127.0.0.1")
    p.add_argument("--port", type=integer(0, 65535), default=8000)
    p.add_argument("--api-key", type=nonempty, action="append",
                   help="require 'Authorization: Bearer KEY' on every route but /health; repeat for several keys, "
                        "each then with a prefix cache of its own")
    p.add_argument("--served-model-name", type=nonempty, default=None)
    p.add_argument("--max-queued-requests", type=integer(0), default=64, help="waiting requests beyond this get 503")
    p.add_argument("--max-request-bytes", type=integer(1), default=16 << 20, help="larger request bodies get 413")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host names answered besides the bound address and localhost; only checked "
                        "when bound to a loopback address, unless given ('*': any)")
    p.add_argument("--shutdown-timeout", type=number(0), default=5.0,
                   help="seconds running requests get to finish after SIGINT / SIGTERM before they are cut")
    p.add_argument("--header-timeout", type=number(0, low_open=True), default=10.0,
                   help="seconds a connection gets to send a request's headers")
    p.add_argument("--body-timeout", type=number(0, low_open=True), default=30.0,
                   help="seconds a request gets to send its body")
    p.add_argument("--keep-alive-timeout", type=number(0, low_open=True), default=5.0,
                   help="idle seconds before a kept-alive connection is closed")
    p.add_argument("--max-connections", type=integer(1), default=None,
                   help="open connections beyond this are closed at once (default: 1024, or what ulimit -n allows)")
    p.add_argument("--reasoning-parser", default="auto", choices=["auto", "kimi_k2", "kimi_k3", "none"],
                   help="how chat output is split into reasoning_content and content (auto: kimi_k3 for XTML "
                        "prompts, else kimi_k2's <think>...</think>; none: all content)")
    p.add_argument("--generation-config", type=nonempty, default="auto",
                   help="request defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens): "
                        "'auto' reads the model's generation_config.json, 'vllm' uses none, or a folder holding one")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="generate a completion for one prompt")
    add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template as a user message")
    p.add_argument("--max-tokens", type=integer(1), default=64)
    p.add_argument("--temperature", type=number(0), default=0.0)
    p.add_argument("--top-p", type=number(0, 1, low_open=True), default=1.0)
    p.add_argument("--seed", type=integer(*SEED_RANGE), default=None)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    add_model_args(p, optional=True)
    p.add_argument("--system", default=None)
    p.add_argument("--max-tokens", type=integer(1), default=256)
    p.add_argument("--temperature", type=number(0), default=0.7)
    p.add_argument("--seed", type=integer(*SEED_RANGE), default=None)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="measure load, prefill, decode and prefix-reuse speed")
    add_model_args(p)
    p.add_argument("--prompt-tokens", type=integer(1), default=512)
    p.add_argument("--decode-tokens", type=integer(1), default=32)
    p.add_argument("--batch", type=integer(1), default=8)
    p.add_argument("--json", action="store_true")
    p.add_argument("--perplexity", metavar="FILE",
                   help="instead of speed: perplexity and bits per character of FILE (windows of --max-model-len)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("inspect", help="checkpoint audit and memory estimate (reads headers and index only)")
    p.add_argument("model")
    p.add_argument("--context", type=integer(1), default=4096)
    p.add_argument("--tp", type=integer(1), default=1)
    p.add_argument("--json", action="store_true")
    p.add_argument("--metadata-only", action="store_true", help="only config.json and the index are present")
    p.add_argument("--device-memory", type=integer(1), default=None, help="bytes per device, for a fit verdict")
    p.add_argument("--max-num-seqs", type=integer(1), default=8)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("convert", help="rewrite a checkpoint with MXFP4 routed experts (compressed-tensors layout)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--experts", default="mxfp4", choices=["mxfp4"])
    p.add_argument("--force", action="store_true", help="write into a non-empty DST")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("make-tiny", help="write a random-weight checkpoint in the official layout")
    p.add_argument("dst")
    p.add_argument("--seed", type=integer(0, SEED_RANGE[1]), default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--preset", default="tiny", choices=["tiny", "bench"], help="bench: hidden 1024, 12 layers, 32 experts")
    p.set_defaults(func=cmd_make_tiny)
    return parser


def run_torchrun_worker(args: argparse.Namespace) -> None:
    """Under torchrun, ranks other than 0 only serve their slice of the model to rank 0."""
    import functools

    from .llm import LoadConfig, context_length, make_runner
    from .models.registry import load_config
    from .parallel import worker_main
    size = int(os.environ["WORLD_SIZE"])
    max_len = context_length(load_config(args.model, args.hf_overrides)[1], args.max_model_len)
    load = LoadConfig(args.model, args.dtype, args.device, args.chunk_size, args.hf_overrides, args.quantization)
    factory = functools.partial(make_runner, load, args.max_num_seqs, max_len)
    worker_main(int(os.environ["RANK"]), size, None, factory)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)           # first: a bad flag is refused before torch is imported
    from .chat import ChatTemplateError
    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .engine import RequestError
    from .runner import ModelFailure
    from .tokenizer import TokenizerError
    if int(os.environ.get("RANK", "0")) > 0 and getattr(args, "tensor_parallel_size", 1) > 1:
        args.func = run_torchrun_worker
    try:
        args.func(args)
    except (CheckpointError, ConfigError, TokenizerError, RequestError, ChatTemplateError, ValueError, OSError,
            GenerationFailed, ModelFailure) as e:       # OSError: paths (permissions, directories, symlink loops)
        print(f"deltaserve: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
