"""The `deltaserve` command as a user runs it."""
import json
import re
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


def test_bad_checkpoint_is_one_clear_line(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    r = run("generate", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"deltaserve: error: {tmp_path / 'config.json'}: not valid JSON")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_missing_cuda_is_one_clear_line(tiny_dir):
    r = run("generate", str(tiny_dir), "--prompt", "x", "--device", "cuda")
    assert r.returncode == 2 and r.stderr.startswith("deltaserve: error: device 'cuda': CUDA is not available")
