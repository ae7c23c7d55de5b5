"""MXFP4 experts under tensor parallelism (its own module: one tensor-parallel group per process at a time)."""
import pytest

from deltaserve import LLM
from deltaserve.config import ConfigError


def ids(n):
    return [(5 + 7 * i) % 470 + 3 for i in range(n)]


def test_mxfp4_experts_shard_block_aligned(tmp_path):
    from deltaserve.convert import convert
    from deltaserve.tiny import make_tiny
    src = make_tiny(tmp_path / "bf16", seed=5, moe_intermediate_size=64)     # 32 columns per rank: whole blocks
    dst = tmp_path / "mxfp4"
    convert(src, dst)
    ids_ = ids(100)
    expected = LLM(dst, dtype="float32").logits(ids_)
    with LLM(dst, dtype="float32", tensor_parallel_size=2) as sharded:
        got = sharded.logits(ids_)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    from deltaserve.models.registry import load_config
    spec, cfg = load_config(dst)
    four_heads = cfg.with_(kda_num_heads=4, num_attention_heads=4)
    with pytest.raises(ConfigError, match=r"moe_intermediate_size / 32 \(MXFP4 blocks, never split\) = 2 is not "
                                          "divisible by 4"):
        spec.check_tp(four_heads, 4)


def test_a_failed_load_leaves_no_rank_behind(tiny_dir, tmp_path):
    import json
    import os
    import shutil

    from deltaserve.checkpoint import CheckpointError
    from test_tensor_parallel import _children
    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    shard = bad / json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated shard"):
        LLM(bad, tensor_parallel_size=2)
    assert _children(os.getpid()) == []
    with LLM(tiny_dir, tensor_parallel_size=2) as ok:           # the process can start a group again
        assert ok.logits([5, 6, 7]).shape == (3, 512)
