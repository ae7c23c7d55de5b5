"""Grammar engines for structured output, measured on a Kimi-sized vocabulary: install size, tokenizer set-up,
compile time of a 20-field JSON schema, and the time to compute one token mask.

    python benchmarks/grammar_engines.py [--docs 5] [--json]

The vocabulary has Kimi's shape (163,584 ordinary tokens + 256 specials = 163,840): the 256 bytes, the 20,902 CJK
ideographs, and the most frequent pieces (words, their prefixes, digits, punctuation, whitespace) of the Python
standard library's sources. Engines that are not installed are skipped; to measure the alternatives without adding
them to the project:
    pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi     # then PYTHONPATH=/tmp/xg
    pip install --no-deps --target /tmp/oc outlines-core               # then PYTHONPATH=/tmp/oc
Each engine replays the same token ids of a few valid documents (compact JSON, which all three are set to require)
and computes the mask before every token, as a serving engine does; every token must be allowed by its mask.
(The documents have no escaped quotes: xgrammar 0.2.9 rejects `\"` inside a string that has a maxLength.)
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import statistics
import sysconfig
import time
from collections import Counter
from pathlib import Path

import numpy as np
import tiktoken
import torch

from deltaserve.tokenizer import KIMI_PAT_STR

ORDINARY, SPECIAL = 163_584, 256
VOCAB = ORDINARY + SPECIAL
EOS = ORDINARY + 1          # Kimi's [EOS] / <|im_end|> sit just after the ordinary ranks

SCHEMA_20 = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 24},
        "email": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "phone": {"type": "string", "maxLength": 16},
        "created": {"type": "string", "maxLength": 24},
        "updated": {"type": ["string", "null"], "maxLength": 24},
        "balance": {"type": "number", "minimum": 0},
        "level": {"type": "integer", "minimum": 1, "maximum": 10},
        "verified": {"type": "boolean"},
        "notes": {"type": "string", "maxLength": 40},
        "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 24},
                                                     "number": {"type": "integer"}},
                    "required": ["street", "number"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
    },
    "required": ["id", "name", "email", "age", "score", "active", "role", "tags", "city", "country", "zip", "phone",
                 "created", "updated", "balance", "level", "verified", "notes", "address", "scores"],
    "additionalProperties": False,
}


def without_max_length(schema: dict) -> dict:
    """The schema with every string's maxLength removed (OpenAI's strict mode does not support maxLength)."""
    if isinstance(schema, dict):
        return {k: without_max_length(v) for k, v in schema.items() if k != "maxLength"}
    return schema


def kimi_sized_encoding() -> tiktoken.Encoding:
    """A tiktoken Encoding with Kimi's vocabulary size and a realistic mix of token lengths and scripts."""
    ranks = {bytes([b]): b for b in range(256)}
    for c in range(0x4E00, 0x9FA6):
        ranks.setdefault(chr(c).encode(), len(ranks))
    words: Counter = Counter()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts):
        words.update(re.findall(r" ?[A-Za-z]+| ?\d{1,3}| ?[^\sA-Za-z\d]+|\s+", f.read_text(errors="ignore")))
    pieces: Counter = Counter()
    for word, n in words.items():          # a word and its prefixes, as BPE merges build them up
        b = word.encode()
        for k in range(2, len(b) + 1):
            pieces[b[:k]] += n
    for piece, _ in sorted(pieces.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(ranks) == ORDINARY:
            break
        ranks.setdefault(piece, len(ranks))
    assert len(ranks) == ORDINARY, f"only {len(ranks)} distinct pieces in the corpus"
    specials = {f"<|reserved_token_{i}|>": i for i in range(ORDINARY, VOCAB)}
    return tiktoken.Encoding("kimi-sized", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def installed_mib(*dists: str) -> float:
    """Bytes on disk of the installed files of these distributions."""
    total = 0
    for d in dists:
        total += sum(f.locate().stat().st_size for f in importlib.metadata.files(d) or [] if f.locate().exists())
    return total / 2**20


def documents(enc: tiktoken.Encoding, n: int) -> list[list[int]]:
    """Token ids of `n` valid instances of SCHEMA_20 in compact JSON, each ending with EOS: the path a model
    would take, replayed through every engine."""
    words = ["alpha", "river", "Zürich", "北京市", "data", "serve", "kernel", "delta", "naïve", "résumé",
             "token"]
    docs = []
    for k in range(n):
        w = lambda i: words[(k * 7 + i) % len(words)]
        doc = {"id": 1000 + k, "name": f"{w(0)} {w(1)}", "email": f"{w(2)}.{k}@example.com", "age": 20 + k,
               "score": 0.5 + k, "active": k % 2 == 0, "role": ["admin", "user", "guest"][k % 3],
               "tags": [w(3), w(4)], "city": w(5), "country": w(6), "zip": f"{10000 + k:05d}",
               "phone": f"+41 44 {k:03d} 00", "created": "2025-01-02T03:04:05Z", "updated": None,
               "balance": 12.25 * (k + 1), "level": 1 + k % 10, "verified": True,
               "notes": f"{w(7)} said {w(8)}, twice", "address": {"street": f"{w(9)} road", "number": 7 + k},
               "scores": [k, 2 * k, 3]}
        docs.append(enc.encode(json.dumps(doc, ensure_ascii=False, separators=(",", ":"))) + [EOS])
    return docs


def replay(fill_mask, row: torch.Tensor, accept, tokens: list[int]) -> list[float]:
    """Times of `fill_mask` at every step of `tokens`; every token must be allowed by the mask and accepted."""
    times = []
    for i, token in enumerate(tokens):
        t0 = time.perf_counter()
        fill_mask()
        times.append(time.perf_counter() - t0)
        assert (int(row[token // 32]) >> (token % 32)) & 1, f"step {i}: token {token} not allowed"
        if token != EOS:
            assert accept(token) is not False, f"step {i}: token {token} rejected"
    return times


def bench_llguidance(enc: tiktoken.Encoding, docs: list[list[int]], schema: dict) -> dict:
    import llguidance
    import llguidance.tiktoken
    t0 = time.perf_counter()
    tok = llguidance.tiktoken.lltokenizer_from_encoding(enc, n_vocab=VOCAB, eos_token=EOS)
    setup = time.perf_counter() - t0
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    compile_s, times = [], []
    for tokens in docs:
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema), log_level=0)
        compile_s.append(time.perf_counter() - t0)
        assert not m.is_error(), m.get_error()
        row = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)

        times += replay(lambda: m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4), row, m.consume_token,
                        tokens)
    return {"engine": f"llguidance {llguidance.__version__}", "install_mib": installed_mib("llguidance"),
            "extra_deps": "none", "tokenizer_setup_s": setup, "compile_s": compile_s,
            "mask_s": times}


def bench_xgrammar(enc: tiktoken.Encoding, docs: list[list[int]], schema: dict) -> dict:
    import xgrammar as xgr
    t0 = time.perf_counter()
    vocab = [enc.decode_single_token_bytes(i) for i in range(VOCAB)]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    setup = time.perf_counter() - t0
    compile_s, times = [], []
    for tokens in docs:
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        compile_s.append(time.perf_counter() - t0)
        m = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, VOCAB)

        times += replay(lambda: m.fill_next_token_bitmask(bitmask), bitmask[0], m.accept_token, tokens)
    return {"engine": f"xgrammar {importlib.metadata.version('xgrammar')}",
            "install_mib": installed_mib("xgrammar", "apache-tvm-ffi"),
            "extra_deps": "triton (on Linux x86-64, a 273 MiB wheel), transformers, pydantic",
            "tokenizer_setup_s": setup, "compile_s": compile_s, "mask_s": times}


def bench_outlines_core(enc: tiktoken.Encoding, docs: list[list[int]], schema: dict) -> dict:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
    t0 = time.perf_counter()
    vocab = outlines_core.Vocabulary(EOS, {enc.decode_single_token_bytes(i): [i] for i in range(ORDINARY)})
    setup = time.perf_counter() - t0
    compile_s, times = [], []
    for tokens in docs:
        t0 = time.perf_counter()
        index = outlines_core.Index(build_regex_from_schema(json.dumps(schema), ""), vocab)
        compile_s.append(time.perf_counter() - t0)
        guide = outlines_core.Guide(index)
        row = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)

        times += replay(lambda: guide.write_mask_into(row.data_ptr(), row.numel(), 4), row,
                        lambda token: guide.advance(token, return_tokens=False), tokens)
    return {"engine": f"outlines-core {importlib.metadata.version('outlines-core')}",
            "install_mib": installed_mib("outlines-core"), "extra_deps": "none", "tokenizer_setup_s": setup,
            "compile_s": compile_s, "mask_s": times}


def apply_us(batch: int, constrained: int, repeats: int = 200) -> float:
    """Mean time of deltaserve's apply_bitmask_ on [batch, 163840] float32 logits with `constrained` masked rows."""
    from deltaserve.structured import apply_bitmask_
    logits = torch.randn(batch, VOCAB)
    bitmask = torch.randint(-2**31, 2**31 - 1, (constrained, (VOCAB + 31) // 32), dtype=torch.int32)
    rows = list(range(constrained))
    apply_bitmask_(logits, bitmask, rows)
    t0 = time.perf_counter()
    for _ in range(repeats):
        apply_bitmask_(logits, bitmask, rows)
    return (time.perf_counter() - t0) / repeats * 1e6


def summary(r: dict) -> dict:
    us = [t * 1e6 for t in r["mask_s"]]
    return {"engine": r["engine"], "install_mib": round(r["install_mib"], 1), "extra_deps": r["extra_deps"],
            "tokenizer_setup_s": round(r["tokenizer_setup_s"], 2),
            "compile_ms_first": round(1000 * r["compile_s"][0], 1),
            "compile_ms_median": round(1000 * statistics.median(r["compile_s"]), 1),
            "mask_us_mean": round(statistics.mean(us)), "mask_us_median": round(statistics.median(us)),
            "mask_us_p99": round(float(np.percentile(us, 99))), "steps": len(us)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=5, help="documents replayed per engine (each compiles the schema)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    t0 = time.perf_counter()
    enc = kimi_sized_encoding()
    print(f"vocabulary: {enc.n_vocab} tokens, built in {time.perf_counter() - t0:.1f}s; "
          f"{torch.get_num_threads()} torch threads")
    docs = documents(enc, args.docs)
    threads = torch.get_num_threads()
    for n in sorted({1, threads}):     # torch's thread pool is slow on an oversubscribed machine: show both
        torch.set_num_threads(n)
        print(f"deltaserve apply_bitmask_ on a [8, {VOCAB}] batch, {n} torch thread(s): " + ", ".join(
            f"{apply_us(8, rows):.0f} us for {rows} constrained row(s)" for rows in (1, 8)))
    torch.set_num_threads(threads)
    results = []
    for bench, module in ((bench_llguidance, "llguidance"), (bench_xgrammar, "xgrammar"),
                          (bench_outlines_core, "outlines_core")):
        try:
            __import__(module)
        except ImportError:
            print(f"{module}: not installed, skipped")
            continue
        for strings, schema in (("strings with maxLength", SCHEMA_20), ("free strings", without_max_length(SCHEMA_20))):
            results.append({**summary(bench(enc, docs, schema)), "schema": f"20 fields, {strings}"})
            print(json.dumps(results[-1]) if args.json else
                  "{engine} ({schema}): install {install_mib} MiB (+ {extra_deps}); "
                  "tokenizer set-up {tokenizer_setup_s} s; compile {compile_ms_first} ms first, "
                  "{compile_ms_median} ms median; mask {mask_us_mean} us mean, {mask_us_median} us median, "
                  "{mask_us_p99} us p99 over {steps} tokens".format(**results[-1]))

if __name__ == "__main__":
    main()
