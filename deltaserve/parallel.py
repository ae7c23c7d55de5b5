"""Tensor parallelism: the sharding plan (which checkpoint tensors split along which dimension) and its checks.

Megatron style, by checkpoint name: KDA q/k/v and their conv taps, f_b/g_b, dt_bias, A_log and beta split by
head; MLA q (or q_b) and kv_b split by head; routed experts, shared experts and dense MLPs split along their
intermediate dimension (gate/up rows, down columns); embedding and LM head split by vocabulary. Every
output projection (o_proj, down) is row-parallel, so one all-reduce follows each mixer and each FFN. The
low-rank down projections (f_a, g_a, kv_a, q_a), their norms, the router and all RMSNorms are replicated.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .config import ConfigError, ModelConfig
from .runner import ModelRunner
from .state import Snapshot


@dataclass(frozen=True)
class TP:
    """This process's place in the tensor-parallel group (size 1: no communication at all)."""
    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension (vocab-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

SPLIT_RULES: tuple[tuple[re.Pattern, int], ...] = tuple((re.compile(p), d) for p, d in (
    (r"self_attn\.[qkv]_proj\.weight$", 0),
    (r"self_attn\.[qkv]_conv1d\.weight$", 0),
    (r"self_attn\.[fg]_b_proj\.weight$", 0),
    (r"self_attn\.b_proj\.weight$", 0),
    (r"self_attn\.dt_bias$", 0),
    (r"self_attn\.A_log$", 2),
    (r"self_attn\.q_b_proj\.weight$", 0),
    (r"self_attn\.kv_b_proj\.weight$", 0),
    (r"self_attn\.o_proj\.weight$", 1),
    (r"(mlp|shared_experts)\.(gate|up)_proj\.weight$", 0),
    (r"(mlp|shared_experts)\.down_proj\.weight$", 1),
    (r"experts\.\d+\.w[13]\.weight(_packed|_scale)?$", 0),
    (r"experts\.\d+\.w2\.weight(_packed|_scale)?$", 1),
    (r"(embed_tokens|lm_head)\.weight$", 0),
))


def split_dim(name: str) -> int | None:
    """The dimension along which `name` is split across ranks, or None if every rank holds all of it."""
    return next((d for pattern, d in SPLIT_RULES if pattern.search(name)), None)


def check_divisible(cfg: ModelConfig, tp: int) -> None:
    """Refuse, before loading anything, a configuration whose split dimensions do not divide by tp."""
    dims = {
        "linear_attn_config.num_heads (KDA heads)": cfg.kda_num_heads,
        "num_attention_heads (MLA heads)": cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "vocab_size": cfg.vocab_size,
    }
    for name, value in dims.items():
        if value % tp:
            raise ConfigError(f"{name} = {value} is not divisible by {tp} (tensor_parallel_size)")
    if cfg.experts_mxfp4 and (cfg.moe_intermediate_size // tp) % 32:
        raise ConfigError(f"moe_intermediate_size / tensor_parallel_size = {cfg.moe_intermediate_size // tp} must be a "
                          "multiple of 32 so MXFP4 blocks are not split")


# ---- processes -----------------------------------------------------------------------------------------------
# Rank 0 runs the engine (and the server); ranks 1..N-1 run `worker_main`, replaying every runner operation rank
# 0 performs, so all ranks take part in the same collectives in the same order. Operations are broadcast as
# small Python objects (token ids, slot numbers, snapshot ids); tensors never travel except in collectives.

TIMEOUT = timedelta(minutes=10)


def _die_with_parent() -> None:
    """Linux: ask the kernel to kill this worker when its parent (rank 0) dies, so no rank is ever orphaned."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)    # PR_SET_PDEATHSIG
    except OSError:
        pass


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def worker_main(rank: int, size: int, init_method: str | None,
                make_runner: Callable[[str | None, TP], ModelRunner]) -> None:
    """Ranks 1..N-1: join the group, load this rank's slices, then replay rank 0's operations until told to stop."""
    _die_with_parent()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    runner = make_runner(init_method, TP(rank, size))
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        op, args = box[0]
        if op == "stop":
            break
        if op == "snapshot":
            slot, length, snapshot_id = args
            runner.snapshot(slot, length, torch.empty(0), snapshot_id)
        else:
            getattr(runner, op)(*args)
    dist.destroy_process_group()


def join_group(tp: TP, init_method: str | None, device: str) -> None:
    if init_method is None:            # launched by torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are set
        dist.init_process_group(backend_for(device), timeout=TIMEOUT)
    else:
        dist.init_process_group(backend_for(device), init_method=init_method, rank=tp.rank, world_size=tp.size,
                                timeout=TIMEOUT)
    if device.startswith("cuda"):
        torch.cuda.set_device(tp.rank % torch.cuda.device_count())


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def start_workers(size: int, make_runner: Callable[[str | None, TP], ModelRunner]) -> tuple[list[Any], str | None]:
    """Spawn ranks 1..size-1 on this host (unless torchrun started them); returns (processes, init method)."""
    if dist.is_initialized():          # torch.distributed has one default group per process
        raise RuntimeError("a tensor-parallel group already exists in this process: one tensor-parallel LLM per "
                           "process; close() the other one first")
    if launched_by_torchrun():
        if int(os.environ["WORLD_SIZE"]) != size:
            raise ConfigError(f"tensor_parallel_size {size} differs from torchrun's WORLD_SIZE {os.environ['WORLD_SIZE']}")
        return [], None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    context = torch.multiprocessing.get_context("spawn")
    procs = [context.Process(target=worker_main, args=(rank, size, init_method, make_runner), daemon=True,
                             name=f"deltaserve-tp{rank}") for rank in range(1, size)]
    for p in procs:
        p.start()
    return procs, init_method


def stop_workers(procs: list[Any], wait: float = 10.0) -> None:
    """Make sure the worker ranks are gone and this process has left the group (after close() or a failure)."""
    for p in procs:
        p.join(wait)
        if p.is_alive():
            p.kill()
            p.join()
    if dist.is_initialized():
        dist.destroy_process_group()


class TPRunner(ModelRunner):
    """Rank 0's runner: every operation is announced to the other ranks, then done here too."""

    def __init__(self, model: Any, num_slots: int, max_len: int, procs: list[Any]):
        super().__init__(model, num_slots, max_len)
        self.procs = procs
        self.closed = False

    def _check_ranks(self, wait: float = 0.0) -> None:
        for rank, p in enumerate(self.procs, start=1):
            p.join(wait)
            if not p.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} died (exit code {p.exitcode})")

    def _announce(self, op: str, *args: Any) -> None:
        self._check_ranks()
        self._collective(dist.broadcast_object_list, [(op, args)], src=0)

    def _collective(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run something that talks to the other ranks; a failure caused by a dead rank says so."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError:
            self._check_ranks(wait=2.0)
            raise

    def forward(self, tokens: list[list[int]], slots: list[int], starts: list[int]) -> torch.Tensor:
        self._announce("forward", tokens, slots, starts)
        return self._collective(super().forward, tokens, slots, starts)

    def logits(self, ids: list[int], step: int) -> torch.Tensor:
        self._announce("logits", ids, step)
        return self._collective(super().logits, ids, step)

    def reset(self, slot: int) -> None:
        self._announce("reset", slot)
        super().reset(slot)

    def snapshot(self, slot: int, length: int, logits: torch.Tensor, snapshot_id: int | None = None) -> Snapshot:
        snap = super().snapshot(slot, length, logits, snapshot_id)
        self._announce("snapshot", slot, length, snap.id)
        return snap

    def restore(self, slot: int, snap: Snapshot | int) -> None:
        self._announce("restore", slot, snap if isinstance(snap, int) else snap.id)
        super().restore(slot, snap)

    def release(self, snap: Snapshot | int) -> None:
        if not self.closed:
            self._announce("release", snap if isinstance(snap, int) else snap.id)
        super().release(snap)

    def close(self) -> None:
        """Stop every rank and leave the process group."""
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.is_alive() for p in self.procs):
                dist.broadcast_object_list([("stop", ())], src=0)
        except RuntimeError:
            pass                       # a rank is already gone; the others are stopped below
        finally:
            stop_workers(self.procs)
