"""The `deltaserve` command as a user runs it."""
import json
import re
import socket
import subprocess
import sys

import pytest
import torch


def run(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "deltaserve", *args], input=stdin, capture_output=True, text=True,
                          timeout=300)


def test_chat_second_turn_reuses_the_first(tiny_dir):
    r = run("chat", str(tiny_dir), "--max-tokens", "6", "--temperature", "0", stdin="Hello there\nAnd again\n")
    assert r.returncode == 0, r.stderr
    turns = re.findall(r"\[in: (\d+) cached \+ (\d+) new", r.stderr)
    assert len(turns) == 2 and int(turns[0][0]) == 0
    assert int(turns[1][0]) >= int(turns[0][1])            # at least the whole first prompt is reused


def test_generate_prints_the_completion(tiny_dir):
    from deltaserve import LLM, SamplingParams
    expected = LLM(tiny_dir).generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0))[0].text
    r = run("generate", str(tiny_dir), "--prompt", "Once upon a time", "--max-tokens", "8")
    assert r.returncode == 0 and r.stdout == expected + "\n"


def test_bench_json(tiny_dir):
    r = run("bench", str(tiny_dir), "--prompt-tokens", "100", "--decode-tokens", "4", "--batch", "2", "--json")
    result = json.loads(r.stdout)
    assert result["second_turn_cached_tokens"] > 100 and result["decode_tok_s_batch2"] > 0
    # two tokens read more experts than one, and at most twice the weights
    assert result["weight_bytes_per_token"] < result["weight_bytes_per_step_batch2"] < 2 * result["weight_bytes_per_token"]
    assert result["roofline_decode_tok_s_batch2"] > result["roofline_decode_tok_s"]


def test_a_large_batch_reads_every_expert(tiny_dir):
    from deltaserve import LLM
    model = LLM(tiny_dir, enforce_eager=True).model
    everything = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    rows = embed.shape[0]
    steps = [model.weight_bytes_per_step(b) for b in (1, 2, 8, 10_000)]
    assert steps == sorted(steps) and len(set(steps)) == 4
    one_row = embed.numel() * embed.element_size() / rows
    assert abs(steps[-1] - (everything - one_row * (rows - min(rows, 10_000)))) < 1e-3 * everything


def test_bad_checkpoint_is_one_clear_line(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    r = run("generate", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"deltaserve: error: {tmp_path / 'config.json'}: not valid JSON")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_missing_cuda_is_one_clear_line(tiny_dir):
    r = run("generate", str(tiny_dir), "--prompt", "x", "--device", "cuda")
    assert r.returncode == 2 and r.stderr.startswith("deltaserve: error: device 'cuda': CUDA is not available")


BAD_SERVE_OPTIONS = {
    "--max-num-seqs 0": "argument --max-num-seqs: 0 is out of range: it must be >= 1",
    "--port 99999": "argument --port: 99999 is out of range: it must be in [0, 65535]",
    "--tensor-parallel-size 0": "argument --tensor-parallel-size: 0 is out of range: it must be >= 1",
    "--max-model-len 1": "argument --max-model-len: 1 is out of range: it must be >= 2",
    "--prefix-cache-bytes -1": "argument --prefix-cache-bytes: -1 is out of range: it must be >= 0",
    "--chunk-size 0": "argument --chunk-size: 0 is out of range: it must be >= 1",
    "--hf-overrides [1]": "argument --hf-overrides: must be a JSON object",
    "--host no-such-host.invalid": "deltaserve: error: --host no-such-host.invalid: cannot resolve it",
    "--port {taken}": "deltaserve: error: cannot listen on 127.0.0.1:{taken}: Address already in use",
}


@pytest.fixture(scope="module")
def bad_serve_runs():
    """Every case of BAD_SERVE_OPTIONS, run at once (each process imports torch: seconds apiece)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        procs = {case: subprocess.Popen([sys.executable, "-m", "deltaserve", "serve",
                                         *case.replace("{taken}", port).split()],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for case in BAD_SERVE_OPTIONS}
        runs = {case: (p.wait(120), p.stderr.read()) for case, p in procs.items()}
    return port, runs


@pytest.mark.parametrize("case", list(BAD_SERVE_OPTIONS))
def test_bad_serve_options_are_one_line_exit_2_before_serving(bad_serve_runs, case):
    """Refused before 'serving on' is printed, naming the flag, in one line; no traceback, no SIGABRT."""
    port, runs = bad_serve_runs
    code, stderr = runs[case]
    assert code == 2 and BAD_SERVE_OPTIONS[case].replace("{taken}", port) in stderr, stderr
    assert len(stderr.splitlines()) == 1 and "serving on" not in stderr


def test_batch_invariant_flag_reaches_the_engine(tiny_dir):
    from deltaserve.cli import build_parser, load_llm
    for flags, expected in (([], False), (["--batch-invariant"], True)):
        args = build_parser().parse_args(["serve", str(tiny_dir), "--max-num-seqs", "2", *flags])
        assert load_llm(args).engine.batch_invariant is expected


def test_convert_into_its_own_source_is_refused_and_changes_nothing(tiny_dir):
    before = {p.name: p.read_bytes() for p in tiny_dir.iterdir() if p.is_file()}
    r = run("convert", str(tiny_dir), str(tiny_dir), "--experts", "mxfp4", "--force")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "the destination is the source" in r.stderr
    assert {p.name: p.read_bytes() for p in tiny_dir.iterdir() if p.is_file()} == before


def test_filesystem_errors_are_one_clear_line(tmp_path):
    (tmp_path / "config.json").mkdir()
    r = run("generate", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "config.json" in r.stderr


def test_a_generation_that_fails_is_one_clear_line(nan_dir):
    """NaN weights: sampling has no distribution to draw from; the command says so in one line."""
    r = run("generate", str(nan_dir), "--prompt", "x", "--temperature", "1", "--max-tokens", "2", "--enforce-eager")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("deltaserve: error: generation failed:")
