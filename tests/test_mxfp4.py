"""MXFP4 numerics, the converted checkpoint layout, and serving MXFP4 experts directly."""
import json

import pytest
import torch
from safetensors import safe_open

from deltaserve import LLM
from deltaserve.checkpoint import CheckpointError
from deltaserve.cli import main
from deltaserve.convert import convert
from deltaserve.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e2m1_values_pack_low_nibble_first_and_roundtrip():
    row = torch.tensor([v for m in E2M1 for v in (m, -m)] * 2)          # 32 values, scale 2^0
    packed, scale = quantize_mxfp4(row[None])
    assert scale.tolist() == [[127]]
    # element 0 (+0) and 1 (-0 -> +0) share byte 0; then 0.5 (code 1) low, -0.5 (code 9) high -> 0x91
    assert packed[0, :2].tolist() == [0x00, 0x91] and packed.dtype == torch.uint8
    assert torch.equal(dequantize_mxfp4(packed, scale)[0], row.abs() * torch.where(row < 0, -1.0, 1.0))


def test_midpoints_round_to_even_and_scales_are_per_block():
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    block = torch.cat([mids, -mids, torch.zeros(17), torch.tensor([4.0])])    # amax 5 -> OCP exponent 0
    other = torch.full((32,), 12.0)                                          # amax 12 -> exponent 1, exact
    packed, scale = quantize_mxfp4(torch.cat([block, other])[None])
    out = dequantize_mxfp4(packed, scale)[0]
    assert scale.tolist() == [[127, 128]]
    assert out[:7].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert out[7:14].tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    assert torch.all(out[32:] == 12.0)


def test_ocp_scale_saturates_the_block_maximum():
    block = torch.zeros(32)
    block[0] = 7.9                                                    # floor(log2 7.9) - 2 = 0: 7.9 -> 6
    packed, scale = quantize_mxfp4(block[None])
    assert scale.item() == 127 and dequantize_mxfp4(packed, scale)[0, 0].item() == 6.0


def test_scale_rule_beats_the_alternatives():
    """The documented choice: the OCP rule has the lowest error on Gaussian and heavy-tailed weights."""
    g = torch.Generator().manual_seed(0)
    for w in (torch.randn(256, 1024, generator=g), torch.distributions.StudentT(3).sample((256, 1024))):
        err = {rule: ((dequantize_mxfp4(*quantize_mxfp4(w, rule)) - w) ** 2).mean() for rule in ("ocp", "round", "ceil")}
        assert err["ocp"] < err["round"] and err["ocp"] < err["ceil"]


def test_width_must_be_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 48))


@pytest.fixture(scope="module")
def mxfp4_dir(tiny_dir, tmp_path_factory):
    dst = tmp_path_factory.mktemp("mx") / "ckpt"
    main(["convert", str(tiny_dir), str(dst), "--experts", "mxfp4"])
    return dst


def test_converted_layout_is_compressed_tensors(mxfp4_dir, tiny_dir):
    cfg = json.loads((mxfp4_dir / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "mxfp4-pack-quantized"
    index = json.loads((mxfp4_dir / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.block_sparse_moe.experts.3.w2"
    assert f"{name}.weight" not in index and f"{name}.weight_packed" in index
    with safe_open(mxfp4_dir / index[f"{name}.weight_packed"], "pt") as f:
        assert f.get_tensor(f"{name}.weight_packed").shape == (64, 16)             # [out, in / 2]
        assert f.get_tensor(f"{name}.weight_scale").shape == (64, 1)               # [out, in / 32]
        assert f.get_tensor(f"{name}.weight_scale").dtype == torch.uint8
    shared = "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight"
    assert shared in index                                                         # only routed experts change
    assert (mxfp4_dir / "tiktoken.model").exists() and (mxfp4_dir / "chat_template.jinja").exists()


def test_convert_refuses_a_non_empty_destination(tiny_dir, tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty; pass --force"):
        convert(tiny_dir, tmp_path)
    convert(tiny_dir, tmp_path, force=True)
    assert (tmp_path / "keep.txt").exists() and (tmp_path / "config.json").exists()


def test_mxfp4_logits_equal_the_dequantized_model(mxfp4_dir, tiny_dir):
    packed = LLM(mxfp4_dir, dtype="float32")
    dense = LLM(tiny_dir, dtype="float32")
    for d, p in zip(dense.model.modules(), packed.model.modules()):
        if hasattr(p, "w13_packed"):
            assert p.w13_packed.dtype == torch.uint8 and not hasattr(p, "w13")    # kept packed in memory
            d.w13.copy_(dequantize_mxfp4(p.w13_packed, p.w13_scale))
            d.w2.copy_(dequantize_mxfp4(p.w2_packed, p.w2_scale))
    ids = list(range(5, 165))
    assert (packed.logits(ids) - dense.logits(ids)).abs().max() <= 1e-4


def test_mxfp4_stays_within_quantization_error_of_the_original(mxfp4_dir, tiny_dir):
    packed, original = LLM(mxfp4_dir, dtype="float32"), LLM(tiny_dir, dtype="float32")
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    for o, p in zip(original.model.modules(), packed.model.modules()):
        if hasattr(p, "w13_packed"):
            assert ((o(x) - p(x)).norm() / o(x).norm()) <= 0.25      # ~0.11 RMS weight error through SwiGLU
    ids = list(range(5, 165))
    a, b = original.logits(ids).flatten(), packed.logits(ids).flatten()
    assert torch.corrcoef(torch.stack([a, b]))[0, 1] >= 0.85


def test_float_tensor_where_packed_bytes_belong_is_refused(mxfp4_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    dst = tmp_path / "bad"
    shutil.copytree(mxfp4_dir, dst)
    name = "model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"
    file = dst / json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(file)
    tensors[name] = tensors[name].to(torch.bfloat16)
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=f"tensor {name} has dtype BF16, expected U8"):
        LLM(dst)


def test_dequantization_is_exact_in_bfloat16():
    """Every E2M1 value times a power of two is a bf16 number: the bf16 path equals the fp32 one bit for bit."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 64)[:, None]
    packed, scale = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.bfloat16).float(), dequantize_mxfp4(packed, scale))
