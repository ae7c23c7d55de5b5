"""The compiled model (deltaserve/compiled.py): decode steps equal to eager ones, every graph compiled during warmup,
nothing recompiled while serving, and a failed compile falls back to eager."""
import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.layers.linear import CPU_BF16_ARITHMETIC


def decode_both_ways(llm: LLM, batch: int, steps: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of `steps` decode steps of `batch` sequences (different lengths, non-contiguous slots), compiled and
    eager, each from the same state, the same tokens fed."""
    runner = llm.runner
    slots = list(range(batch))[::-1]
    prompts = [list(range(3 + 5 * i, 20 + 9 * i)) for i in range(batch)]
    for slot, p in zip(slots, prompts):
        runner.reset(slot)
        runner.forward([p], [slot], [0])
    saved = {k: v.clone() for k, v in runner.pool.tensors.items()}
    feed = torch.randint(1, llm.cfg.vocab_size, (steps, batch), generator=torch.Generator().manual_seed(batch))
    out = []
    for compiled in (True, False):
        for k, v in runner.pool.tensors.items():
            v.copy_(saved[k])
        compiled_step = runner.compiled
        runner.compiled = compiled_step if compiled else None
        out.append(torch.stack([runner.forward([[t] for t in feed[i].tolist()], slots, [len(p) + i for p in prompts])
                                for i in range(steps)]))
        runner.compiled = compiled_step
    return out[0], out[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_decode_equals_eager(tiny_dir, dtype):
    llm = LLM(tiny_dir, dtype=dtype, enforce_eager=False)
    if llm.runner.compiled is None:
        pytest.skip("needs the CPU decode kernels (x86 with AVX2 or AVX-512 and a C++ compiler)")
    torch._dynamo.utils.ReinplaceCounters.clear()
    for batch in (1, 3, 8):
        compiled, eager = decode_both_ways(llm, batch)
        assert not llm.runner.compiled.decode.failed
        if dtype == "float32":
            assert (compiled - eager).abs().max() <= 1e-4
        elif batch == 1 and not CPU_BF16_ARITHMETIC:
            # eager's roundings (emulate_precision_casts), same kernels; where bf16 products run in bf16, inductor's
            # own small attention products sum in another order (one bf16 rounding apart)
            assert torch.equal(compiled, eager)
        else:
            assert torch.equal(compiled.argmax(-1), eager.argmax(-1))
            assert (compiled - eager).abs().max() <= 0.05
    assert set(llm.runner.compiled.decode.compile_seconds) == {1, 2}     # one graph for one row, one for 2..8
    # the kernels' in-place state updates stayed in place: no copy of a pool tensor per step
    assert torch._dynamo.utils.ReinplaceCounters.get_total_missed() == 0


def test_each_model_keeps_its_own_graphs(tiny_dir, tmp_path):
    """A decode step compiles into graphs of its model's own (compiled.own_code), which check no guards on the model:
    a second model of the same shapes but other constants (routed_scaling_factor, rms_norm_eps) neither reuses nor
    replaces the first one's."""
    from deltaserve.tiny import make_tiny
    first = LLM(tiny_dir, dtype="float32", enforce_eager=False)
    if first.runner.compiled is None:
        pytest.skip("needs the CPU decode kernels (x86 with AVX2 or AVX-512 and a C++ compiler)")
    other = make_tiny(tmp_path / "other", seed=5, routed_scaling_factor=0.5, rms_norm_eps=1e-2)
    second = LLM(other, dtype="float32", enforce_eager=False)
    counters = torch._dynamo.utils.counters
    for i, llm in enumerate((first, second, first)):
        graphs = counters["stats"]["unique_graphs"]
        compiled, eager = decode_both_ways(llm, 1)
        assert (compiled - eager).abs().max() <= 1e-4
        added = counters["stats"]["unique_graphs"] - graphs
        assert added >= 1 if i < 2 else added == 0                     # the first model's graphs are reused
    assert not first.runner.compiled.decode.failed and not second.runner.compiled.decode.failed


def test_warmup_compiles_and_serving_never_recompiles(tiny_dir):
    llm = LLM(tiny_dir, warmup=True, enforce_eager=False)
    if llm.runner.compiled is None:
        pytest.skip("needs the CPU decode kernels (x86 with AVX2 or AVX-512 and a C++ compiler)")
    assert set(llm.runner.compiled.decode.compile_seconds) == {1, 2}
    counters = torch._dynamo.utils.counters
    graphs = counters["stats"]["unique_graphs"]
    for n, length in ((1, 5), (3, 40), (8, 17), (2, 130), (5, 1)):
        prompts = [list(range(7 + i, 7 + i + length)) for i in range(n)]
        out = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.7, seed=n, ignore_eos=True))
        assert all(len(o.token_ids) == 4 for o in out)
    assert counters["stats"]["unique_graphs"] == graphs
    assert not llm.runner.compiled.decode.failed


def test_enforce_eager_and_a_failed_compile_run_eagerly(tiny_dir, monkeypatch, capsys):
    assert LLM(tiny_dir, enforce_eager=True).runner.compiled is None
    llm = LLM(tiny_dir, enforce_eager=False)
    if llm.runner.compiled is None:
        pytest.skip("needs the CPU decode kernels (x86 with AVX2 or AVX-512 and a C++ compiler)")

    def broken(*args, **kwargs):
        raise torch._dynamo.exc.Unsupported("no compiler")
    monkeypatch.setattr(llm.runner.compiled.decode, "compiled", broken)
    prompt = list(range(5, 80))
    got = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0))
    assert got[0].token_ids == LLM(tiny_dir, enforce_eager=True).generate(
        [prompt], SamplingParams(max_tokens=3, temperature=0))[0].token_ids
    assert llm.runner.compiled.decode.failed == {1}
    err = capsys.readouterr().err
    assert "compiling the decode step failed (Unsupported: no compiler); running it eagerly" in err


def test_one_shot_commands_run_eagerly_and_the_flag_is_honoured(tiny_dir, monkeypatch):
    """generate and bench --perplexity would spend longer compiling than working; --enforce-eager turns it off."""
    from deltaserve.cli import build_parser, load_llm
    monkeypatch.delenv("DELTASERVE_ENFORCE_EAGER")
    parse = build_parser().parse_args
    compiled = load_llm(parse(["generate", str(tiny_dir), "--prompt", "x"])).runner.compiled
    if compiled is None:
        pytest.skip("needs the CPU decode kernels (x86 with AVX2 or AVX-512 and a C++ compiler)")
    assert load_llm(parse(["generate", str(tiny_dir), "--prompt", "x"]), one_shot=True).runner.compiled is None
    assert load_llm(parse(["serve", str(tiny_dir), "--enforce-eager"])).runner.compiled is None


def test_a_compiled_server_serves_concurrent_requests(tiny_dir):
    """The compiled graphs are built during the server's warmup in its engine thread, then serve concurrent batched
    requests with nothing compiled, as the ready line and the log say."""
    import concurrent.futures

    import openai

    from server_utils import Server
    server = Server(str(tiny_dir), timeout=300, env={"DELTASERVE_ENFORCE_EAGER": "0"})
    try:
        ready = next(line for line in server.stderr().splitlines() if "ready" in line)
        if "graphs compiled" not in ready:
            pytest.skip("needs the CPU decode kernels (x86 with AVX2 or AVX-512 and a C++ compiler)")
        assert "2 graphs compiled" in ready
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        model = client.models.list().data[0].id

        def one(i: int) -> int:
            r = client.completions.create(model=model, prompt=[7 + j for j in range(1 + 9 * i)], max_tokens=6,
                                          temperature=0.0, extra_body={"ignore_eos": True})
            return r.usage.completion_tokens
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(10))) == [6] * 10
    finally:
        log = server.stop()
    assert "compiling the" not in log and "Recompiling" not in log


def test_compiled_graphs_are_cached_per_vector_isa(tmp_path):
    """Inductor's graph cache does not key on the vector ISA: AVX-512 loops read back under AVX2 computed NaNs. The
    default directory (replacing the one torch sets when torch._dynamo is imported) differs when torch is told to use
    another ISA (or none); a directory the user set is kept."""
    import os
    import subprocess
    import sys
    probe = ("import os, torch._dynamo; from deltaserve.compiled import configure_inductor; configure_inductor(); "
             "print(os.environ['TORCHINDUCTOR_CACHE_DIR'])")

    def cache_dir(capability: str | None, user_dir: str | None = None) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR")}
        env["XDG_CACHE_HOME"] = str(tmp_path)
        if capability is not None:
            env["ATEN_CPU_CAPABILITY"] = capability
        if user_dir is not None:
            env["TORCHINDUCTOR_CACHE_DIR"] = user_dir
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        return out.stdout.strip()

    native, plain = cache_dir(None), cache_dir("default")
    assert native.startswith(str(tmp_path / "deltaserve" / "inductor")) and plain.startswith(str(tmp_path))
    if not native.endswith("invalid_vec_isa"):          # a CPU without vector ISA: both are the same
        assert native != plain
    assert cache_dir(None, str(tmp_path / "mine")) == str(tmp_path / "mine")
