"""Kimi K3 under tensor parallelism (2 ranks, gloo): the official layout sliced per rank equals one process; and a
rank that dies before joining is reported in seconds with its cause."""
import subprocess
import sys
import textwrap
import time

from deltaserve import LLM, SamplingParams

from test_kimi_k3 import FIXTURE

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_k3_two_ranks_equal_one_process(monkeypatch):
    ids = [(7 * i + 3) % 250 for i in range(60)]
    single = LLM(FIXTURE, dtype="float32")
    expected, tokens = single.logits(ids), single.generate([ids], GREEDY)[0].token_ids
    with LLM(FIXTURE, dtype="float32", tensor_parallel_size=2) as tp:
        got = tp.logits(ids)
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
        assert tp.generate([ids], GREEDY)[0].token_ids == tokens
        import deltaserve.distributed as distributed
        calls = []
        real = distributed.dist.all_reduce
        monkeypatch.setattr(distributed.dist, "all_reduce", lambda *a, **k: calls.append(1) or real(*a, **k))
        tp.runner.reset(0)
        tp.runner.forward([[5]], [0], [0])
        # 2 per layer (mixer, FFN) + 2 per latent MoE (its input, its routed sum) + 1 vocab-parallel embedding
        assert len(calls) == 2 * 6 + 2 * 5 + 1


def test_a_rank_that_dies_before_joining_is_reported_in_seconds(tmp_path):
    """A script without a main guard: spawn re-imports it in the child, which fails while bootstrapping."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from deltaserve import LLM
        LLM({str(FIXTURE)!r}, dtype="float32", tensor_parallel_size=2)
    """))
    t0 = time.time()
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and time.time() - t0 < 60
    assert "tensor-parallel rank 1 died before joining the tensor-parallel group" in r.stderr
    assert 'if __name__ == "__main__":' in r.stderr
