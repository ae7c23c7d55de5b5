"""The decode step a CUDA graph captures (cuda_graphs.py), run eagerly on a CPU: routed experts without a host sync
equal the grouped loop, and a step through a `graph_view` (slots and lengths only as tensors, attention over a fixed
span) equals the ordinary step, logits and state. The capture and replay themselves are in test_cuda.py."""
import pytest
import torch

from deltaserve import LLM
from deltaserve.cuda_graphs import attention_spans
from deltaserve.layers.moe import MoE
from deltaserve.models.kimi_linear import TINY_CONFIG, parse_config


@pytest.mark.parametrize("variant", ["fp32", "bf16", "situ"])
def test_gathered_experts_equal_the_grouped_loop(variant, monkeypatch):
    raw = {**TINY_CONFIG, "moe_intermediate_size": 64, "num_experts_per_token": 4}
    if variant == "situ":
        raw["hidden_act"] = "situ"
    cfg = parse_config(raw)
    dtype = torch.bfloat16 if variant == "bf16" else torch.float32
    torch.manual_seed(0)
    moe = MoE(cfg, dtype)
    for p in moe.parameters():
        p.copy_(torch.randn_like(p.float()) * 0.2)
    monkeypatch.setattr("deltaserve.layers.moe.kernels", lambda: None)
    for n in (1, 3, 8):
        x = torch.randn(n, cfg.hidden_size).to(dtype)
        loop = moe(x)
        monkeypatch.setattr(MoE, "gathers_experts", property(lambda self: True))
        gathered = moe(x)
        monkeypatch.undo()
        monkeypatch.setattr("deltaserve.layers.moe.kernels", lambda: None)
        if dtype == torch.float32:
            assert (gathered - loop).abs().max() <= 1e-5 * loop.abs().max()
        else:       # one bf16 rounding of the terms apart (their products sum in another order)
            assert (gathered.float() - loop.float()).abs().max() <= 0.02 * loop.float().abs().max()


def test_graph_view_step_equals_the_ordinary_step(tiny_dir, monkeypatch):
    """Three sequences of different lengths in non-contiguous slots, one decode step each way from the same state,
    with every layer on its PyTorch path (the one CUDA runs)."""
    llm = LLM(tiny_dir, dtype="float32", max_model_len=96)
    runner, model = llm.runner, llm.runner.model
    for m in model.modules():
        if hasattr(m, "fused_step"):
            m.fused_step = None
    monkeypatch.setattr("deltaserve.layers.moe.kernels", lambda: None)
    monkeypatch.setattr(MoE, "gathers_experts", property(lambda self: True))
    slots, prompts = [5, 1, 3], [list(range(3, 20)), list(range(7, 60)), list(range(2, 9))]
    for slot, p in zip(slots, prompts):
        runner.reset(slot)
        runner.forward([p], [slot], [0])
    saved = {k: v.clone() for k, v in runner.pool.tensors.items()}
    tokens, starts = torch.tensor([[11], [12], [13]]), [len(p) for p in prompts]
    ordinary = model(tokens, runner.pool.view(slots, starts), last_only=True)
    after = {k: v.clone() for k, v in runner.pool.tensors.items()}
    for k, v in runner.pool.tensors.items():
        v.copy_(saved[k])
    for span in (64, 96):
        view = runner.pool.graph_view(torch.tensor(slots), torch.tensor(starts), span)
        assert (model(tokens, view, last_only=True) - ordinary).abs().max() <= 1e-5
        for k, v in runner.pool.tensors.items():
            assert (v - after[k]).abs().max() <= 1e-5, k
            v.copy_(saved[k])


def test_attention_spans_cover_the_context():
    assert attention_spans(3000) == [256, 512, 1024, 2048, 3000]
    assert attention_spans(512) == [256, 512] and attention_spans(100) == [100]
