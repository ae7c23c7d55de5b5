"""Tensor parallelism over torch.distributed (gloo on CPU), 2 ranks: same results as one process."""
import os
import signal
import subprocess
import time

import httpx
import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.config import ConfigError

from server_utils import Server

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def single(tiny_dir):
    return LLM(tiny_dir, dtype="float32", prefill_tokens=64)


@pytest.fixture(scope="module")
def tp(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", prefill_tokens=64, tensor_parallel_size=2)
    yield llm
    llm.close()


def ids(n, start=5):
    return [(start + 7 * i) % 470 + 3 for i in range(n)]


def test_logits_equal_single_process(single, tp):
    a, b = single.logits(ids(170)), tp.logits(ids(170))
    # Reordered fp32 sums (row-parallel partials) differ by ulps; the random model's MLA layer amplifies the
    # earlier layers' ulp-level differences ~7x, so the bound is 1e-5 of the logit scale (measured: 4e-6).
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()


def test_greedy_generation_batching_and_prefix_reuse_equal_single_process(single, tp):
    prompts = [ids(150), ids(40, start=11), ids(90, start=23)]
    assert [o.token_ids for o in tp.generate(prompts, GREEDY)] == [o.token_ids for o in single.generate(prompts, GREEDY)]
    first = tp.generate([ids(120, 31)], GREEDY)[0]
    follow_up = ids(120, 31) + first.token_ids + ids(10, 41)
    reused = tp.generate([follow_up], GREEDY)[0]
    assert reused.num_cached_tokens == 120 + len(first.token_ids) - 1
    assert reused.token_ids == single.generate([follow_up], GREEDY)[0].token_ids


def test_each_rank_holds_a_slice(single, tp):
    full = sum(p.numel() for p in single.model.parameters())
    mine = sum(p.numel() for p in tp.model.parameters())
    assert full / 2 < mine < 0.6 * full          # replicated: norms, router, low-rank down projections


def test_indivisible_configuration_is_refused_before_loading(tiny_dir):
    with pytest.raises(ConfigError, match=r"\(KDA heads\) = 2 is not divisible by 3"):
        LLM(tiny_dir, tensor_parallel_size=3)


def _children(pid):
    """The worker ranks of a server (multiprocessing's spawned processes, not its resource tracker)."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line]


def test_server_with_two_ranks_answers_and_shuts_down_cleanly(tiny_dir):
    server = Server(str(tiny_dir), "--tensor-parallel-size", "2")
    ranks = _children(server.proc.pid)
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert ranks, "the worker rank runs as a child process"
    finally:
        server.stop()
    time.sleep(1)
    assert not [p for p in ranks if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]]


def test_a_dead_rank_stops_the_server(tiny_dir):
    server = Server(str(tiny_dir), "--tensor-parallel-size", "2")
    try:
        (rank1,) = _children(server.proc.pid)
        os.kill(rank1, signal.SIGKILL)
        try:
            httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        except httpx.HTTPError:
            pass
        assert server.proc.wait(30) != 0
    finally:
        err = server.stop()
    assert "tensor-parallel rank 1 died" in err, err


def test_one_all_reduce_per_mixer_and_per_ffn(tp, monkeypatch):
    """A decode step costs 2 all-reduces per layer, 1 for the vocab-parallel embedding, 1 logits all-gather."""
    import deltaserve.distributed as distributed
    calls = {"all_reduce": 0, "all_gather": 0}
    for name in calls:
        real = getattr(distributed.dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(distributed.dist, name, counted)
    tp.runner.reset(0)
    tp.runner.forward([[5]], [0], [0])
    assert calls == {"all_reduce": 2 * tp.cfg.num_hidden_layers + 1, "all_gather": 1}


def test_a_second_group_in_one_process_is_refused(tiny_dir, tp):
    before = _children(os.getpid())
    with pytest.raises(RuntimeError, match="one tensor-parallel LLM per process"):
        LLM(tiny_dir, tensor_parallel_size=2)
    assert _children(os.getpid()) == before          # refused before starting any process


def test_torchrun_launch_serves_like_one_process(tiny_dir, single):
    """Every rank started by torchrun (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT): rank 0 serves."""
    import sys

    from server_utils import free_port
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), "-m", "deltaserve", "serve", str(tiny_dir),
                             "--dtype", "float32", "--tensor-parallel-size", "2", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 90
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {"prompt": ids(60), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert r.json()["choices"][0]["text"] == single.generate([ids(60)], SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True))[0].text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    time.sleep(1)
    leftovers = subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True, text=True).stdout.split()
    for pid in leftovers:
        os.kill(int(pid), signal.SIGKILL)
    assert not leftovers
