"""Chat templates: the checkpoint's jinja template rendered in a sandbox (as transformers does), or a built-in
Kimi template when the checkpoint has none; rendered straight to token ids in which only the template's own markers
are special tokens."""
from __future__ import annotations

import json
import secrets
from datetime import datetime
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

# Kimi-K2-Instruct's format (the checkpoints' chat_template.jinja; tests/data/kimi_k2_instruct.jinja is that template
# and tests/test_text.py requires both to give the same ids): role segments concatenated without newlines except the
# one after the default system prompt, which the official template also emits; tool declarations as compact JSON;
# assistant tool calls re-rendered with their ids; a tool result under the tool's name as "## Return of {id}".
KIMI_TEMPLATE = (
    "{%- macro text(m) -%}{%- if m.content is string -%}{{ m.content }}"
    "{%- elif m.content -%}{%- for part in m.content -%}{{ part.text }}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message.role != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>{{ '\\n' }}"
    "{%- endif -%}"
    "{%- set name = message.name or message.role -%}"
    "{%- if message.role == 'user' -%}<|im_user|>{{ name }}<|im_middle|>"
    "{%- elif message.role == 'assistant' -%}<|im_assistant|>{{ name }}<|im_middle|>"
    "{%- else -%}<|im_system|>{{ name }}<|im_middle|>{%- endif -%}"
    "{%- if message.role == 'tool' -%}## Return of {{ message.tool_call_id }}{{ '\\n' }}{%- endif -%}"
    "{{ text(message) }}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}<|tool_calls_section_begin|>"
    "{%- for call in message.tool_calls -%}<|tool_call_begin|>{{ call.id }}<|tool_call_argument_begin|>"
    "{%- if call.function.arguments is string -%}{{ call.function.arguments }}"
    "{%- else -%}{{ call.function.arguments | tojson }}{%- endif -%}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
# The names render() gives the template itself; chat_template_kwargs may not replace them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})


def tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
           separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson` filter: json.dumps with its arguments, no HTML escaping, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def sorted_keys(value: Any) -> Any:
    """Every mapping's keys sorted, recursively: Kimi's tokenizer passes tool declarations to the template so."""
    if isinstance(value, dict):
        return {k: sorted_keys(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [sorted_keys(v) for v in value]
    return value


class ChatTemplateError(ValueError):
    pass


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str | None, special_tokens: dict[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(source or KIMI_TEMPLATE)
        self.special_tokens = special_tokens or {}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        """`template_kwargs`: more template variables (a request's chat_template_kwargs, e.g. thinking=False)."""
        kwargs = template_kwargs or {}
        if not isinstance(messages, list) or not messages:
            raise ChatTemplateError("messages: must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ChatTemplateError(f"messages[{i}]: needs a string 'role'")
            if not (m.get("content") is None or isinstance(m["content"], (str, list))):
                raise ChatTemplateError(f"messages[{i}].content: must be a string or a list of parts")
        clash = sorted(RESERVED_VARIABLES.intersection(kwargs))
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs: '{clash[0]}' is set by the request itself")
        try:
            return self.template.render({**self.special_tokens, **kwargs, "messages": messages,
                                         "tools": sorted_keys(tools), "add_generation_prompt": add_generation_prompt})
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None
        except Exception as e:  # noqa: BLE001 - the request's data (e.g. a chat_template_kwargs value) broke it
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None

    def render_ids(self, tokenizer: "Tokenizer | None", messages: list[dict[str, Any]],
                   add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
                   template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The conversation as token ids, with everything the caller wrote (contents, roles, names, tool
        definitions) as plain text: special-token text typed there is encoded as ordinary text, so a user cannot
        forge turns. Each such occurrence is swapped for an unguessable placeholder before rendering, so the
        template's logic still sees the rest of the text as sent, and put back as plain text when encoding."""
        if tokenizer is None:
            raise ChatTemplateError("this checkpoint has no tokenizer: chat needs one (send token ids instead)")
        literals: dict[str, str] = {}
        nonce = secrets.token_hex(8)

        def placeholder(special: Any) -> str:
            key = f"\ue000{nonce}.{len(literals)}\ue001"
            literals[key] = special.group()
            return key

        def shield(value: Any) -> Any:
            if isinstance(value, str):
                return tokenizer.special_text.sub(placeholder, value)
            if isinstance(value, list):
                return [shield(v) for v in value]
            if isinstance(value, dict):
                return {shield(k): shield(v) for k, v in value.items()}
            return value
        text = self.render(shield(messages), add_generation_prompt, shield(tools), shield(template_kwargs))
        return tokenizer.encode_with_literals(text, literals)
