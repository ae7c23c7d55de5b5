import os
import sys

import pytest

# Compiling the decode step costs seconds per model; tests that are not about it run eagerly (test_compiled.py
# turns it on explicitly). Servers started by tests inherit this.
os.environ.setdefault("DELTASERVE_ENFORCE_EAGER", "1")

# transformers dispatches KDA to fla's GPU-only Triton kernels when fla is importable; keep it on its torch path.
sys.modules["fla"] = None

from deltaserve.tiny import make_tiny  # noqa: E402

# Three random configurations covering the config space the parity tests exercise.
CONFIGS = {
    "base": {},
    "qlora_grouped": dict(q_lora_rank=16, num_experts=16, num_experts_per_token=4, num_expert_group=4, topk_group=2,
                          routed_scaling_factor=1.5, moe_renormalize=False),
    "mla_first": dict(num_hidden_layers=4, first_k_dense_replace=2, num_shared_experts=2, hidden_size=48,
                      linear_attn_config={"full_attn_layers": [1, 4], "kda_layers": [2, 3], "head_dim": 32,
                                          "num_heads": 3, "short_conv_kernel_size": 3}),
}


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """name -> checkpoint directory, one per entry of CONFIGS (bf16 on disk, like the official release)."""
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_tiny(root / name, seed=i, **over) for i, (name, over) in enumerate(CONFIGS.items())}


@pytest.fixture(scope="session")
def tiny_dir(tiny_dirs):
    return tiny_dirs["base"]


@pytest.fixture(scope="session")
def nan_dir(tiny_dir, tmp_path_factory):
    """The tiny checkpoint with NaN token embeddings: it loads, but no distribution can be sampled from it."""
    import shutil

    from safetensors.torch import load_file, save_file
    nan = tmp_path_factory.mktemp("nan") / "ckpt"
    shutil.copytree(tiny_dir, nan)
    for shard in nan.glob("*.safetensors"):
        tensors = load_file(shard)
        if "model.embed_tokens.weight" in tensors:
            tensors["model.embed_tokens.weight"].fill_(float("nan"))
            save_file(tensors, shard, metadata={"format": "pt"})
    return nan
