"""Bad checkpoints fail at load with a message naming the file, the tensor and the shapes."""
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from deltaserve import LLM
from deltaserve.checkpoint import CheckpointError
from deltaserve.config import ConfigError

NAME = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture
def ckpt(tiny_dir, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, dst)
    return dst


def shard_of(path, name):
    return path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


def rewrite(path, name, change):
    file = shard_of(path, name)
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)
    return file


def test_missing_tensor(ckpt):
    rewrite(ckpt, NAME, lambda t: t.pop(NAME))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"][NAME]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"missing tensor\(s\) {NAME} \(expected shape \[32, 64\]\)"):
        LLM(ckpt)


def test_index_naming_a_tensor_its_shard_lacks(ckpt):
    file = rewrite(ckpt, NAME, lambda t: t.pop(NAME))
    with pytest.raises(CheckpointError, match=rf"lists tensor {NAME} in {file.name}"):
        LLM(ckpt)


def test_unexpected_tensor(ckpt):
    file = rewrite(ckpt, NAME, lambda t: t.update({"model.layers.1.self_attn.bogus.weight": t[NAME].clone()}))
    with pytest.raises(CheckpointError, match=rf"unexpected tensor\(s\) model.layers.1.self_attn.bogus.weight in {file.name}"):
        LLM(ckpt)


def test_shape_mismatch(ckpt):
    file = rewrite(ckpt, NAME, lambda t: t.update({NAME: t[NAME][:, :16].contiguous()}))
    with pytest.raises(CheckpointError, match=rf"{file}: tensor {NAME} has shape \[32, 16\], expected \[32, 64\]"):
        LLM(ckpt)


def test_truncated_shard(ckpt):
    file = shard_of(ckpt, NAME)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=rf"{file}: truncated shard: {len(data) - 1000} bytes on disk, its header needs {len(data)}"):
        LLM(ckpt)


def test_garbage_shard(ckpt):
    file = shard_of(ckpt, NAME)
    file.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=rf"{file}: not a readable safetensors file"):
        LLM(ckpt)


@pytest.mark.parametrize("field,value,message", [
    ("model_type", "llama", "model_type: 'llama' is not supported"),
    ("hidden_size", -4, "hidden_size: -4 must be a positive integer"),
    ("moe_router_activation_func", "softmax", "moe_router_activation_func: 'softmax' is not supported"),
    ("linear_attn_config", {"kda_layers": [1, 2], "full_attn_layers": [4], "num_heads": 2, "head_dim": 16,
                            "short_conv_kernel_size": 4}, "must together name each of the 5 layers"),
    ("num_experts_per_token", 99, "num_experts_per_token: 99 exceeds num_experts"),
    ("q_lora_rank", "big", "q_lora_rank: 'big' must be null or a positive integer"),
])
def test_bad_config_value(ckpt, field, value, message):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[field] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        LLM(ckpt)


@pytest.mark.parametrize("weight_map,message", [
    ({NAME: "/etc/passwd"}, "shard '/etc/passwd' is not a file name in"),
    ({NAME: "../model-00001-of-00002.safetensors"}, "is not a file name in"),
    ({NAME: 3}, "is not a file name in"),
    ({NAME: ".."}, "is not a file name in"),
    ({NAME: ""}, "is not a file name in"),
    ([NAME], "not a valid safetensors index"),
])
def test_index_naming_shards_outside_the_checkpoint_or_malformed(ckpt, weight_map, message):
    index = ckpt / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=message):
        LLM(ckpt)


def test_a_config_dtype_the_engine_cannot_run_names_the_config(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "int8"}))
    with pytest.raises(ValueError, match="dtype auto: the checkpoint's config.json gives 'int8'"):
        LLM(ckpt)
    assert LLM(ckpt, dtype="float32").cfg.torch_dtype == "int8"          # an explicit dtype still loads it
