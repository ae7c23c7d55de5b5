"""The `deltaserve` command."""
from __future__ import annotations

import argparse
import sys


def cmd_make_tiny(args: argparse.Namespace) -> None:
    from .tiny import make_tiny
    path = make_tiny(args.dst, seed=args.seed, dtype=args.dtype, preset=args.preset,
                     shards=4 if args.preset == "bench" else 2)
    print(f"wrote a random Kimi Linear checkpoint to {path}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltaserve", description="Serve hybrid linear-attention LLMs (Kimi Linear).")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="write a random-weight checkpoint in the official layout")
    p.add_argument("dst")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--preset", default="tiny", choices=["tiny", "bench"], help="bench: hidden 1024, 12 layers, 32 experts")
    p.set_defaults(func=cmd_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> None:
    from .checkpoint import CheckpointError
    from .config import ConfigError
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (CheckpointError, ConfigError, FileExistsError) as e:
        print(f"deltaserve: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
