"""`deltaserve inspect`: exact byte counts from headers and index only, checked against hand-computed values."""
import json
import shutil
from pathlib import Path

import pytest

from deltaserve.audit import audit
from deltaserve.checkpoint import CheckpointError
from deltaserve.cli import main
from deltaserve.config import ConfigError
from deltaserve.convert import QUANTIZATION_CONFIG
from deltaserve.models.registry import load_config

KIMI_48B = Path(__file__).parent.parent / "benchmarks" / "kimi-linear-48b-a3b"

# The tiny config by hand: D=64, V=512, 5 layers (KDA 0,1,2,4; MLA 3), KDA H=2 K=16 W=4, MLA heads 2,
# r=32, rope 8, nope 16, v 16; dense I=96 in layer 0; 4 MoE layers of 8 experts of I=32 + 1 shared; bf16.
D, V, E, I = 64, 512, 8, 32
ROUTED = 4 * E * 3 * I * D * 2                         # 393,216
SHARED = 4 * 3 * I * D * 2                             # 49,152
EMBEDDINGS = 2 * V * D * 2                             # 131,072
LATENT_1000 = 1 * 1000 * (32 + 8) * 2                  # 80,000: one MLA layer, c_kv | k_pe in bf16
RECURRENT = 4 * (2 * 16 * 16 * 4 + 3 * 3 * 32 * 2)     # 10,496: fp32 state + bf16 conv window, 4 KDA layers


def test_tiny_checkpoint_numbers_match_hand_computation(tiny_dir):
    r = audit(tiny_dir, context=1000, tp=2)
    assert r["bytes_by_role"]["routed_experts"] == ROUTED
    assert r["bytes_by_role"]["shared_experts"] == SHARED
    assert r["bytes_by_role"]["embeddings"] == EMBEDDINGS
    assert r["mla_latent_cache_bytes_per_sequence"] == LATENT_1000
    assert r["recurrent_state_bytes_per_sequence"] == RECURRENT
    assert r["recurrent_state_bytes_per_sequence_per_device"] == RECURRENT // 2
    assert r["prefix_snapshot_bytes_per_conversation"] == RECURRENT + LATENT_1000 + V * 4
    # fp32 as published: dt_bias, A_log and conv taps of 4 KDA layers, the router correction bias of 4 MoE layers
    assert r["bytes_by_dtype"]["F32"] == 4 * (2 * 16 + 2 + 3 * 32 * 4) * 4 + 4 * E * 4
    assert r["total_bytes"] == sum(f.stat().st_size for f in Path(tiny_dir).glob("*.safetensors")) - sum(
        8 + int.from_bytes(f.read_bytes()[:8], "little") for f in Path(tiny_dir).glob("*.safetensors"))
    assert not r["missing"] and not r["unexpected"] and len(r["shards"]) == 2
    # TP 2 halves every split tensor; replicated ones (norms, router, low-rank down projections) stay whole
    assert r["total_bytes"] // 2 < r["weight_bytes_per_device"] < r["total_bytes"]


def test_metadata_only_reads_config_and_index_alone(tiny_dir, tmp_path):
    for name in ("config.json", "model.safetensors.index.json"):
        shutil.copy(Path(tiny_dir) / name, tmp_path / name)
    meta = audit(tmp_path, context=1000, tp=2, metadata_only=True)
    full = audit(tiny_dir, context=1000, tp=2)
    for key in ("total_bytes", "bytes_by_role", "bytes_by_dtype", "weight_bytes_per_device", "tensor_count"):
        assert meta[key] == full[key]


def test_reports_missing_and_unexpected_against_the_config(tiny_dir, tmp_path):
    shutil.copy(Path(tiny_dir) / "config.json", tmp_path / "config.json")
    index = json.loads((Path(tiny_dir) / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.bogus.weight"] = index["weight_map"].pop("model.norm.weight")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    r = audit(tmp_path, metadata_only=True)
    assert r["missing"] == ["model.norm.weight"] and r["unexpected"] == ["model.layers.0.bogus.weight"]


def test_real_kimi_linear_config_has_49_12b_parameters():
    """transformers' model built on `meta` from the released config counts 49.12 B (spec §0, verified)."""
    r = audit(KIMI_48B, context=4096, metadata_only=True)
    assert round(r["parameters"] / 1e9, 2) == 49.12
    assert r["mla_latent_cache_bytes_per_sequence"] == 7 * 4096 * 576 * 2


def test_converted_48b_size_matches_the_seed_checkpoint(tmp_path):
    """The seed's MXFP4 conversion of the same model is 29,051,930,368 bytes, with its fp32 tensors cast to bf16;
    ours keeps those in fp32, so it must be exactly half their bytes larger."""
    cfg = json.loads((KIMI_48B / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": QUANTIZATION_CONFIG}))
    r = audit(tmp_path, metadata_only=True)
    assert r["total_bytes"] - r["bytes_by_dtype"]["F32"] // 2 == 29_051_930_368


def test_fit_verdict_and_json_output(tiny_dir, capsys):
    main(["inspect", str(tiny_dir), "--json", "--context", "100", "--device-memory", "1000"])
    r = json.loads(capsys.readouterr().out)
    assert r["fits"] is False and r["bytes_needed_per_device"] > 1000
    assert audit(tiny_dir, device_memory=10**9)["fits"] is True


def test_indivisible_tensor_parallel_configuration_is_refused(tiny_dir):
    spec, cfg = load_config(tiny_dir)
    spec.check_tp(cfg, 2)
    with pytest.raises(ConfigError, match=r"linear_attn_config.num_heads \(KDA heads\) = 2 is not divisible by 4"):
        spec.check_tp(cfg, 4)


def test_metadata_only_checks_the_index_shard_names(tiny_dir, tmp_path):
    shutil.copy(Path(tiny_dir) / "config.json", tmp_path / "config.json")
    index = json.loads((Path(tiny_dir) / "model.safetensors.index.json").read_text())
    index["weight_map"] = {name: 7 for name in index["weight_map"]}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="is not a file name in"):
        audit(tmp_path, metadata_only=True)
