"""Logits equal transformers' native KimiLinearForCausalLM loaded from the same official-layout files."""
import pytest
import torch

from deltaserve import LLM

from conftest import CONFIGS


def reference_logits(path, ids):
    from transformers import KimiLinearForCausalLM
    model, info = KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info        # every tensor of our layout is consumed, none initialised
    with torch.no_grad():
        return model.eval()(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("length", [157, 200])
def test_logits_match_transformers(tiny_dirs, name, length):
    ids = torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    ref = reference_logits(tiny_dirs[name], ids)
    ours = LLM(tiny_dirs[name], dtype="float32", chunk_size=64 if name != "mla_first" else 16).logits(ids)
    assert ref.abs().max() > 1.0               # the random model is far from trivial
    assert (ours - ref).abs().max().item() <= 1e-4


def test_biased_router_weights_switch_changes_logits(tiny_dir):
    """The HF remote code's variant (biased scores as weights) is a config switch, and it matters."""
    ids = list(range(3, 40))
    plain = LLM(tiny_dir, dtype="float32").logits(ids)
    biased = LLM(tiny_dir, dtype="float32", hf_overrides={"router_bias_in_weights": True}).logits(ids)
    assert (plain - biased).abs().max() > 1e-3
