"""Kimi K3 from its official layout, against the seed system's reference outputs (../shared/oracles/kimi-k3-tiny),
and each K3 feature against a direct formula."""
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deltaserve import LLM, SamplingParams
from deltaserve.audit import audit
from deltaserve.checkpoint import CheckpointError
from deltaserve.layers.kda import forget_gate
from deltaserve.layers.mlp import situ
from deltaserve.layers.moe import MoE, top_k_lowest_index_on_ties
from deltaserve.layers.norm import RMSNorm
from deltaserve.layers.residual import depth_mix, mix_params
from deltaserve.models.kimi_k3 import parse_config
from deltaserve.ops.mxfp4 import dequantize_mxfp4
from deltaserve.ops.mxfp8 import quantize_dequantize_mxfp8

FIXTURE = Path(__file__).parent.parent.parent / "shared" / "oracles" / "kimi-k3-tiny"
K3_CONFIG = Path(__file__).parent.parent / "benchmarks" / "kimi-k3"
SEED = {"kda_output_gate_activation": "silu", "kda_a_log_layout": "per_channel"}   # the seed system's reading
MODES = {"__official_guess": None, "": SEED, "__kda_gate_sigmoid": {"kda_a_log_layout": "per_channel"},
         "__kda_alog_per_head": {"kda_output_gate_activation": "silu"}}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ref():
    return load_file(FIXTURE / "reference.safetensors")


@pytest.fixture(scope="module")
def k3():
    return LLM(FIXTURE, dtype="float32")


@pytest.mark.parametrize("mode", list(MODES))
def test_logits_and_greedy_tokens_match_the_reference(ref, mode):
    """Default = published semantics (`__official_guess`); hf_overrides select the seed's (primary keys)."""
    llm = LLM(FIXTURE, dtype="float32", hf_overrides=MODES[mode])
    for T in (1, 7, 40):
        expected = ref[f"logits_{T}{mode}"]
        assert (llm.logits(ref[f"tokens_{T}"].tolist()) - expected).abs().max() <= 5e-3, T
    out = llm.generate([ref["greedy_prompt"].tolist()], GREEDY)[0]
    assert out.token_ids == ref[f"greedy_tokens{mode}"].tolist()


def test_semantic_switches_matter(ref):
    """Each switch moves the logits far beyond the tolerance, so matching a mode is a real check."""
    ids = ref["tokens_40"].tolist()
    default = LLM(FIXTURE, dtype="float32").logits(ids)
    for over in ({"kda_output_gate_activation": "silu"}, {"kda_a_log_layout": "per_channel"},
                 {"expert_input_mxfp8": True}):
        assert (LLM(FIXTURE, dtype="float32", hf_overrides=over).logits(ids) - default).abs().max() > 0.05, over


def test_prefill_then_decode_and_chunked_prefill_equal_one_shot(ref, k3):
    ids = ref["tokens_40"].tolist()
    one_shot = k3.logits(ids)
    pool = k3.runner.pool
    k3.runner.reset(0)
    stepwise = [k3.model(torch.tensor([ids[:13]]), pool.view([0], [0]))[0]]
    for t in range(13, len(ids)):
        stepwise.append(k3.model(torch.tensor([[ids[t]]]), pool.view([0], [t]))[0])
    assert (torch.cat(stepwise) - one_shot).abs().max() <= 1e-4
    for chunk in (4, 16):
        assert (LLM(FIXTURE, dtype="float32", chunk_size=chunk).logits(ids) - one_shot).abs().max() <= 1e-4


def test_prefix_reuse_and_batching_equal_fresh_runs(ref):
    llm = LLM(FIXTURE, dtype="float32", prefill_tokens=16)
    prompts = [ref["tokens_40"].tolist(), ref["greedy_prompt"].tolist(), ref["tokens_7"].tolist()]
    alone = [LLM(FIXTURE, dtype="float32", prefill_tokens=16).generate([p], GREEDY)[0].token_ids for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == alone
    follow_up = prompts[0] + alone[0] + [3, 1, 4]
    reused = llm.generate([follow_up], GREEDY)[0]
    fresh = LLM(FIXTURE, dtype="float32", prefill_tokens=16).generate([follow_up], GREEDY)[0]
    assert reused.num_cached_tokens == len(prompts[0]) + len(alone[0]) - 1
    assert reused.token_ids == fresh.token_ids


def test_mx_codecs_reproduce_the_reference_exactly(ref):
    assert torch.equal(quantize_dequantize_mxfp8(ref["mxfp8_qdq_in"].to(torch.bfloat16)).float(), ref["mxfp8_qdq_out"])
    for key, layer, proj, expert in (("mxfp4_dequant_layer1_w1_expert0", 1, "w1", 0),
                                     ("mxfp4_dequant_layer1_w2_expert15", 1, "w2", 15)):
        name = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}"
        with safe_open(FIXTURE / "model-00001-of-00002.safetensors", "pt") as f:
            packed, scale = f.get_tensor(f"{name}.weight_packed"), f.get_tensor(f"{name}.weight_scale")
        assert torch.equal(dequantize_mxfp4(packed, scale, torch.float32), ref[key])


def test_mxfp8_rounding_saturation_and_subnormals():
    pad = lambda *v: torch.tensor(list(v) + [0.0] * (32 - len(v)))
    assert quantize_dequantize_mxfp8(pad(448, 416, 400, -448))[:4].tolist() == [448, 416, 384, -448]
    assert quantize_dequantize_mxfp8(pad(512))[0] == 448
    assert quantize_dequantize_mxfp8(pad(1, 1.0625, 1.07, 2**-9, 2**-10))[:5].tolist() == [0.875] * 3 + [2**-9, 2**-10]


def test_attention_residual_mix_equals_the_formula():
    g = torch.Generator().manual_seed(0)
    norm, proj = mix_params(16, 1e-5, torch.float32)
    norm.weight.copy_(torch.rand(16, generator=g) + 0.5)
    proj.weight.copy_(torch.randn(1, 16, generator=g))
    values = [torch.randn(2, 3, 16, generator=g) * s for s in (1.0, 4.0, 0.3)]
    got = depth_mix(values, norm, proj)
    v = torch.stack(values).double()
    k = v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-5)
    alpha = torch.softmax((k * norm.weight.double() * proj.weight[0].double()).sum(-1), dim=0)
    assert torch.allclose(got.double(), (alpha.unsqueeze(-1) * v).sum(0), atol=1e-6)


def test_situ_on_known_values():
    gate, up = torch.tensor([0.0, 2.0, -3.0, 40.0]), torch.tensor([5.0, 3.0, 1.0, 100.0])
    sig = lambda x: 1 / (1 + math.exp(-x))
    expected = [4 * math.tanh(g / 4) * sig(g) * 25 * math.tanh(u / 25) for g, u in zip(gate.tolist(), up.tolist())]
    assert torch.allclose(situ(gate, up, 4.0, 25.0), torch.tensor(expected), rtol=1e-6)
    assert situ(gate, up, 4.0, 25.0)[3] < 4 * 25            # both factors are soft-capped


def test_forget_gate_with_and_without_lower_bound():
    f = torch.tensor([0.0, 3.0, -100.0, 100.0])
    a = torch.tensor(2.0)
    bounded = forget_gate(f, a, -5.0)
    assert torch.allclose(bounded, -5.0 / (1 + torch.exp(-a * f)))
    assert bounded[0] == -2.5 and (bounded >= -5).all() and (bounded <= 0).all()
    assert torch.allclose(forget_gate(f, a, None), -a * torch.nn.functional.softplus(f))


def test_wide_router_top_k_matches_torch_topk_and_breaks_ties_to_the_lowest_index():
    g = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 40, (64, 896), generator=g).float() / 40     # many exact ties
    ids = top_k_lowest_index_on_ties(scores, 16)
    assert torch.equal(scores.gather(1, ids), scores.topk(16).values)       # the same values as torch.topk
    for row, chosen in zip(scores, ids):
        kth = row[chosen[-1]]
        tied = (row == kth).nonzero().flatten()
        taken = [i for i in tied.tolist() if i in chosen.tolist()]
        assert taken == tied.tolist()[:len(taken)]                           # ties at the cut: lowest indices


def test_latent_moe_equals_a_dense_reference():
    raw = json.loads((FIXTURE / "config.json").read_text())
    cfg = parse_config({**raw, "quantization_config": None,
                        "text_config": {**raw["text_config"], "quantization_config": None}})
    torch.manual_seed(0)
    moe = MoE(cfg, torch.float64)
    for p in moe.parameters():
        p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(5, cfg.hidden_size, dtype=torch.float64)
    expected = torch.zeros_like(x)
    act = lambda g, u: situ(g, u, cfg.situ_beta, cfg.situ_linear_beta)
    I = cfg.moe_intermediate_size
    for n in range(x.shape[0]):
        scores = torch.sigmoid(moe.gate_weight.double() @ x[n])
        chosen = torch.topk(scores + moe.e_score_correction_bias.double(), cfg.num_experts_per_token).indices
        weights = scores[chosen] / scores[chosen].sum()
        h = moe.routed_expert_down_proj @ x[n]
        routed = sum(w * (moe.w2[e] @ act(moe.w13[e, :I] @ h, moe.w13[e, I:] @ h)) for e, w in zip(chosen, weights))
        norm = RMSNorm(cfg.expert_width, cfg.rms_norm_eps, torch.float64)
        norm.weight.copy_(moe.routed_expert_norm.weight)
        shared = moe.shared_experts
        gate, up = (shared.gate_up @ x[n]).chunk(2)
        expected[n] = moe.routed_expert_up_proj @ norm(routed) + shared.down @ act(gate, up)
    assert torch.allclose(moe(x), expected, atol=1e-9)


def test_vision_tensors_are_skipped_and_never_read(tmp_path):
    ckpt = tmp_path / "k3"
    shutil.copytree(FIXTURE, ckpt)
    shard = ckpt / "model-00001-of-00002.safetensors"
    tensors = load_file(shard)
    vision = [n for n in tensors if not n.startswith("language_model.")]
    assert vision and all(n.startswith(("vision_tower.", "mm_projector.")) for n in vision)
    LLM(ckpt, dtype="float32")


@pytest.mark.parametrize("damage,message", [
    ("missing_shard", "shard file is missing"),
    ("wrong_shape", r"tensor language_model.model.layers.3.self_attn.g_proj.weight has shape \[96, 40\], "
                    r"expected \[96, 80\]"),
])
def test_broken_k3_checkpoint_is_one_clear_error(tmp_path, damage, message):
    ckpt = tmp_path / "k3"
    shutil.copytree(FIXTURE, ckpt)
    if damage == "missing_shard":
        (ckpt / "model-00002-of-00002.safetensors").unlink()
    else:
        name = "language_model.model.layers.3.self_attn.g_proj.weight"
        shard = ckpt / json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][name]
        tensors = load_file(shard)
        tensors[name] = tensors[name][:, :40].contiguous()
        save_file(tensors, shard)
    with pytest.raises(CheckpointError, match=message):
        LLM(ckpt, dtype="float32")


def official_index_names() -> list[str]:
    """The official K3 text tensor names, written from the spec's mapping table (section 2.3), not from our model."""
    full = set(range(3, 92, 4)) | {92}
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
             "model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight"]
    for i in range(93):
        p = f"model.layers.{i}."
        names += [p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                  "self_attention_res_norm.weight", "self_attention_res_proj.weight",
                                  "mlp_res_norm.weight", "mlp_res_proj.weight")]
        attn = (("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "g_proj", "o_proj",
                 "kv_b_proj") if i in full else
                ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "f_b_proj", "b_proj", "o_proj", "q_conv1d",
                 "k_conv1d", "v_conv1d", "o_norm"))
        names += [f"{p}self_attn.{a}.weight" for a in attn]
        if i not in full:
            names += [p + "self_attn.dt_bias", p + "self_attn.A_log"]
        if i == 0:
            names += [f"{p}mlp.{w}_proj.weight" for w in ("gate", "up", "down")]
            continue
        moe = p + "block_sparse_moe."
        names += [moe + "gate.weight", moe + "gate.e_score_correction_bias"]
        names += [f"{moe}shared_experts.{w}_proj.weight" for w in ("gate", "up", "down")]
        names += [f"{moe}routed_expert_{w}.weight" for w in ("down_proj", "up_proj", "norm")]
        names += [f"{moe}experts.{e}.{w}.weight_{part}" for e in range(896) for w in ("w1", "w2", "w3")
                  for part in ("packed", "scale")]
    return ["language_model." + n for n in names]


def test_full_size_k3_metadata_audit_reproduces_the_spec_figures(tmp_path):
    names = official_index_names()
    assert len(names) == 497_052
    names += [f"vision_tower.encoder.blocks.{i}.weight_{j}" for i in range(42) for j in range(3)]
    names += [f"mm_projector.proj.{i}.weight" for i in range(42)]
    shards = [f"model-{i:05d}-of-00096.safetensors" for i in range(1, 97)]
    weight_map = {n: shards[k * 96 // len(names)] for k, n in enumerate(names)}
    index = {"metadata": {"total_size": 1_560_860_324_864}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(K3_CONFIG / "config.json", tmp_path / "config.json")
    r = audit(tmp_path, context=1_048_576, tp=8, metadata_only=True)
    assert r["tensor_count"] == 497_220 and r["skipped_tensors"] == 168 and len(r["shards"]) == 96
    assert not r["missing"] and not r["unexpected"]
    assert r["index_total_size"] == 1_560_860_324_864
    assert r["total_bytes"] == 1_559_965_606_912                            # the text model (spec 2.6)
    assert r["bytes_by_role"]["routed_experts"] == 1_446_456_066_048
    assert sum(".experts." in n for n in names) == 494_592
    assert r["weight_bytes_per_device"] == 196_784_397_312
    assert r["mla_latent_cache_bytes_per_sequence_per_device"] == 28_991_029_248
    assert r["recurrent_state_bytes_per_sequence_per_device"] == 54_263_808 + 1_907_712   # spec 1.5, 69 layers


def test_k3_chat_template_renders_the_xtml_turns():
    from deltaserve.chat import ChatTemplate
    from deltaserve.models.kimi_k3 import XTML_TEMPLATE
    text = ChatTemplate(XTML_TEMPLATE).render([{"role": "user", "content": "Hello"},
                                               {"role": "assistant", "content": "answer", "reasoning_content": "why"},
                                               {"role": "user", "content": 'a "quoted" & name', "name": 'x"y'}])
    assert text.startswith('<|open|>message role="system" type="thinking-effort"<|sep|>')
    assert "Now the system is invoked with `thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>" in text
    assert '<|open|>message role="user"<|sep|>Hello<|close|>message<|sep|><|end_of_msg|>' in text
    assert ("<|open|>think<|sep|>why<|close|>think<|sep|><|open|>response<|sep|>answer<|close|>response<|sep|>"
            in text)
    assert 'name="x&quot;y"' in text
    assert text.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')


@pytest.mark.parametrize("where", ["top", "text", "both"])
def test_quantization_config_is_found_at_either_level(where):
    raw = json.loads((FIXTURE / "config.json").read_text())
    quant = raw.pop("quantization_config")
    text = {k: v for k, v in raw["text_config"].items() if k != "quantization_config"}
    raw = {**raw, "text_config": {**text, **({"quantization_config": quant} if where != "top" else {})},
           **({"quantization_config": quant} if where != "text" else {})}
    assert parse_config(raw).experts_mxfp4
    assert not parse_config({**raw, "quantization_config": None,
                             "text_config": text}).experts_mxfp4
