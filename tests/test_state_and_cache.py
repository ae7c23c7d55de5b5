"""Snapshots are bit-exact; the radix prefix cache matches whole keys only and evicts least recently used."""
import torch

from deltaserve import LLM
from deltaserve.prefix_cache import PrefixCache
from deltaserve.state import Snapshot


def snap(length, nbytes=400):
    return Snapshot(length, {}, torch.zeros(nbytes // 4))


def test_snapshot_restore_is_bit_identical(tiny_dir):
    llm = LLM(tiny_dir, dtype="bfloat16")
    pool = llm.runner.pool
    ids = torch.arange(3, 80)[None]
    llm.model(ids, pool.view([0], [0]))
    saved = pool.snapshot(0, 77, torch.zeros(4))
    before = {k: t[0, :77].clone() if pool.per_token[k] else t[0].clone() for k, t in pool.tensors.items()}
    assert {name for _, name in before} == {"conv", "recurrent", "latent"}
    assert all(t.dtype == torch.float32 for (_, name), t in saved.state.items() if name == "recurrent")
    # MLA's latent cache holds bf16 values: kept in bf16 on every CPU (products widen it where they need fp32)
    assert all(t.dtype == torch.bfloat16 for (_, name), t in pool.tensors.items() if name == "latent")
    llm.model(torch.arange(100, 140)[None], pool.view([0], [77]))             # move the state on
    pool.restore(0, saved)
    for k, t in before.items():
        assert torch.equal(pool.tensors[k][0, :77] if pool.per_token[k] else pool.tensors[k][0], t)


def test_match_returns_longest_whole_key_only():
    cache = PrefixCache(1 << 20)
    cache.insert([1, 2, 3], snap(3))
    cache.insert([1, 2, 3, 4, 5], snap(5))
    cache.insert([1, 2, 9], snap(3))                  # splits the shared edge
    assert cache.match([1, 2, 3, 4, 5, 6]).length == 5
    assert cache.match([1, 2, 3, 4, 7]).length == 3   # diverges inside the 5-token key: falls back to 3
    assert cache.match([1, 2, 9, 9]).length == 3
    assert cache.match([1, 2]) is None and cache.match([7]) is None
    assert cache.match([1, 2, 3, 4, 5], max_len=4).length == 3


def test_lru_eviction_keeps_within_budget():
    cache = PrefixCache(1000)
    cache.insert([1, 1], snap(2))
    cache.insert([2, 2], snap(2))
    cache.match([1, 1, 5])                            # [1, 1] is now more recent than [2, 2]
    cache.insert([3, 3], snap(2))
    assert cache.bytes <= 1000 and cache.entries == 2
    assert cache.match([2, 2]) is None and cache.match([1, 1]) is not None and cache.match([3, 3]) is not None
    cache.insert([4], snap(1, nbytes=4000))           # larger than the whole budget: not stored
    assert cache.match([4]) is None and cache.entries == 2
