"""Tensor-parallel processes: rank 0 runs the engine (and the server); ranks 1..N-1 run `worker_main`, replaying
every runner operation rank 0 performs, so all ranks take part in the same collectives in the same order.
Operations are broadcast as small Python objects (token ids, slot numbers, snapshot ids); tensors never travel
except in collectives. What each rank holds is the model's split plan (models/spec.py); the collectives the model
computes with are in distributed.py.
"""
from __future__ import annotations

import ctypes
import os
import queue
import signal
import socket
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .config import ConfigError
from .distributed import TP
from .runner import ModelFailure, ModelRunner
from .state import Snapshot

TIMEOUT = timedelta(minutes=10)
MAIN_GUARD_HINT = ("spawned ranks re-import the script that started deltaserve: if it creates the LLM or server at "
                   "import time, put that under `if __name__ == \"__main__\":`")


def _die_with_parent() -> None:
    """Linux: ask the kernel to kill this worker when its parent (rank 0) dies, so no rank is ever orphaned."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)    # PR_SET_PDEATHSIG
    except OSError:
        pass


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def worker_main(rank: int, size: int, init_method: str | None,
                make_runner: Callable[[str | None, TP], ModelRunner], reports: Any = None) -> None:
    """Ranks 1..N-1: join the group, load this rank's slices, then replay rank 0's operations until told to stop.
    `reports` (spawned ranks): a queue on which rank 0 learns why this rank failed."""
    _die_with_parent()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    try:
        runner = make_runner(init_method, TP(rank, size))
    except BaseException as e:
        if reports is not None:
            reports.put((rank, "".join(traceback.format_exception_only(type(e), e)).strip()))
        raise
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


class Workers:
    """Ranks 1..N-1 spawned on this host (none when torchrun started them), and what they reported."""

    def __init__(self, size: int, make_runner: Callable[[str | None, TP], ModelRunner]):
        if dist.is_initialized():          # torch.distributed has one default group per process
            raise RuntimeError("a tensor-parallel group already exists in this process: one tensor-parallel LLM per "
                               "process; close() the other one first")
        self.procs: list[Any] = []
        self.init_method: str | None = None
        self.failures: dict[int, str] = {}
        if launched_by_torchrun():
            if int(os.environ["WORLD_SIZE"]) != size:
                raise ConfigError(f"tensor_parallel_size {size} differs from torchrun's WORLD_SIZE "
                                  f"{os.environ['WORLD_SIZE']}")
            return
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        context = torch.multiprocessing.get_context("spawn")
        self.reports = context.Queue()
        self.procs = [context.Process(target=worker_main, daemon=True, name=f"deltaserve-tp{rank}",
                                      args=(rank, size, self.init_method, make_runner, self.reports))
                      for rank in range(1, size)]
        for p in self.procs:
            p.start()

    def _read_reports(self, wait: float = 0.0) -> None:
        """Collect what the ranks reported; failures are kept in self.failures."""
        deadline = time.monotonic() + wait
        while True:
            try:
                rank, detail = self.reports.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            self.failures[rank] = detail

    def join(self, device: str) -> None:
        """Rank 0 enters the rendezvous while watching the spawned ranks: one that dies first (e.g. while
        bootstrapping) is reported with its own error in seconds, not after the rendezvous timeout."""
        size = len(self.procs) + 1
        if not self.procs:                 # torchrun started the other ranks: nothing to watch
            return join_group(TP(0, int(os.environ["WORLD_SIZE"])), None, device)
        done = threading.Thread(target=join_group, args=(TP(0, size), self.init_method, device), daemon=True)
        done.start()
        while done.is_alive():
            done.join(0.1)
            self._read_reports()
            self.check(context="before joining the tensor-parallel group")
        if not dist.is_initialized():
            raise RuntimeError("rank 0 failed to join the tensor-parallel group")

    def check(self, wait: float = 0.0, context: str = "") -> None:
        """Raise if a rank has died, with its own error when it reported one."""
        for rank, p in enumerate(self.procs, start=1):
            p.join(wait)
            if p.is_alive():
                continue
            self._read_reports(wait=0.5)
            cause = self.failures.get(rank)
            hint = f": {cause}" if cause else f" (exit code {p.exitcode}); {MAIN_GUARD_HINT}"
            raise ModelFailure(f"tensor-parallel rank {rank} died{' ' + context if context else ''}{hint}")

    def stop(self, wait: float = 10.0) -> None:
        """Make sure the worker ranks are gone and this process has left the group (after close() or a failure)."""
        for p in self.procs:
            p.join(wait)
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            dist.destroy_process_group()


class TPRunner(ModelRunner):
    """Rank 0's runner: every operation is announced to the other ranks, then done here too."""

    def __init__(self, model: Any, num_slots: int, max_len: int, workers: Workers):
        super().__init__(model, num_slots, max_len)
        self.workers = workers
        self.closed = False

    def _announce(self, op: str, *args: Any) -> None:
        self.workers.check()
        self._collective(dist.broadcast_object_list, [(op, args)], src=0)

    def _collective(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run something that talks to the other ranks; a failure caused by a dead rank says so."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            self.workers.check(wait=2.0)
            raise ModelFailure(f"tensor-parallel collective failed: {e}") from e

    def forward(self, tokens: list[list[int]], slots: list[int], starts: list[int], last_only: bool = True
                ) -> torch.Tensor:
        self._announce("forward", tokens, slots, starts, last_only)
        return self._collective(super().forward, tokens, slots, starts, last_only)

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
            if all(p.is_alive() for p in self.workers.procs):
                dist.broadcast_object_list([("stop", ())], src=0)
        except RuntimeError:
            pass                       # a rank is already gone; the others are stopped below
        finally:
            self.workers.stop()
