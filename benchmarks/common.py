"""Helpers shared by the benchmark scripts."""
from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_checkpoint(path: str | None) -> Path:
    """The given checkpoint, or the bench preset written once to /tmp/deltaserve-bench."""
    if path:
        return Path(path)
    dst = Path("/tmp/deltaserve-bench")
    if not (dst / "config.json").exists():
        from deltaserve.tiny import make_tiny
        print(f"writing the bench preset checkpoint to {dst} ...", file=sys.stderr)
        make_tiny(dst, preset="bench", shards=4)
    return dst


def parser(description: str) -> argparse.ArgumentParser:
    """Arguments every benchmark takes: an optional checkpoint (default: the bench preset) and the dtype."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("checkpoint", nargs="?", help="checkpoint directory (default: the bench preset)")
    p.add_argument("--dtype", default="bfloat16")
    return p
