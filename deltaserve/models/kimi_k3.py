"""Kimi K3: a Kimi Linear family text model inside a multimodal checkpoint.

Everything that differs in the computation (SiTU, latent MoE, full-rank bounded KDA gate, MLA output gate, Block
Attention Residuals) is a KimiConfig field read by the shared layers; this file only says how K3's checkpoint
wraps the text model: config.json's `text_config`, tensor names under `language_model.`, the vision tower and
projector skipped unread, A_log stored padded to head_dim, and the XTML chat template.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..config import ConfigError, Fields
from . import kimi_linear
from .kimi_config import KimiConfig, parse_kimi

# The seed system's XTML template (spec section 4.3), used when the checkpoint ships none. Attribute values escape
# & and "; the assistant turn always carries its (possibly empty) think block.
XTML_TEMPLATE = (
    "{%- macro attr(v) -%}{{ v | replace('&', '&amp;') | replace('\"', '&quot;') }}{%- endmacro -%}"
    "{%- macro text(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part.type != 'text' -%}{{ raise_exception('Kimi K3 XTML template is text-only') }}{%- endif -%}"
    "{{ part.text }}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}{{ raise_exception('Kimi K3 XTML tool rendering is not implemented') }}{%- endif -%}"
    "{%- set effort = thinking_effort | default('max') -%}"
    "{%- if effort not in ['low', 'medium', 'high', 'max'] -%}"
    "{{ raise_exception('thinking_effort must be low, medium, high or max') }}{%- endif -%}"
    "<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>"
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "
    "supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={{ effort }}`."
    "<|close|>message<|sep|><|end_of_msg|>"
    "{%- for m in messages -%}"
    "{%- if m.role not in ['system', 'user', 'assistant'] or m.tool_calls -%}"
    "{{ raise_exception('Kimi K3 XTML template: unsupported role or tool call in ' ~ m.role) }}{%- endif -%}"
    "<|open|>message role=\"{{ attr(m.role) }}\"{% if m.name %} name=\"{{ attr(m.name) }}\"{% endif %}<|sep|>"
    "{%- if m.role == 'assistant' -%}"
    "<|open|>think<|sep|>{{ m.reasoning_content or m.reasoning or '' }}<|close|>think<|sep|>"
    "<|open|>response<|sep|>{{ text(m.content) }}<|close|>response<|sep|>"
    "{%- else -%}{{ text(m.content) }}{%- endif -%}"
    "<|close|>message<|sep|><|end_of_msg|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>{%- endif -%}"
)


def parse_config(raw: dict[str, Any], overrides: dict[str, Any] | None = None) -> KimiConfig:
    """The official config.json: model_type kimi_k3 with the text model's config in `text_config` (hf_overrides
    merge into it); quantization_config at the top level and/or inside text_config; vision settings ignored."""
    text = Fields(raw).get("text_config", kind=dict)
    quant = text.get("quantization_config", raw.get("quantization_config"))
    merged = {"bos_token_id": raw.get("bos_token_id"), "eos_token_id": raw.get("eos_token_id"), **text,
              "quantization_config": quant, **(overrides or {})}
    if merged.get("model_type") != "kimi_linear":
        raise ConfigError(f"text_config.model_type: {merged.get('model_type')!r} is not supported "
                          "(expected 'kimi_linear')")
    return parse_kimi(merged, a_log_padded=True)


SPEC = replace(
    kimi_linear.SPEC,
    model_type="kimi_k3",
    architectures=("KimiK3ForConditionalGeneration",),
    parse_config=parse_config,
    checkpoint_prefix="language_model.",
    fp32_tensors=kimi_linear.SPEC.fp32_tensors + ("o_norm.weight",),
    chat_template=XTML_TEMPLATE,
    tiny_presets={},
)
