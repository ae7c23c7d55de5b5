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

# Kimi-K2-Instruct format: role segments concatenated without newlines.
KIMI_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message.role != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- if message.role == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>{{ message.role }}<|im_middle|>{%- endif -%}"
    "{%- if message.content is string -%}{{ message.content }}"
    "{%- elif message.content -%}{%- for part in message.content -%}"
    "{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


class ChatTemplateError(ValueError):
    pass


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str | None, special_tokens: dict[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(source or KIMI_TEMPLATE)
        self.special_tokens = special_tokens or {}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        if not isinstance(messages, list) or not messages:
            raise ChatTemplateError("messages: must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ChatTemplateError(f"messages[{i}]: needs a string 'role'")
            if not (m.get("content") is None or isinstance(m["content"], (str, list))):
                raise ChatTemplateError(f"messages[{i}].content: must be a string or a list of parts")
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools, **self.special_tokens)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None

    def render_ids(self, tokenizer: "Tokenizer | None", messages: list[dict[str, Any]],
                   add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None) -> list[int]:
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
        text = self.render(shield(messages), add_generation_prompt, shield(tools))
        return tokenizer.encode_with_literals(text, literals)
