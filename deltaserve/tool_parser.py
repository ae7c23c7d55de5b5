"""Tool calls in generated text, turned into OpenAI `tool_calls`, incrementally.

Kimi's format, as trained (special tokens, decoded as their text):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
    <|tool_call_end|>...<|tool_calls_section_end|>

The id is kept as generated (`functions.NAME:IDX`, or a bare `NAME:IDX`): the chat template renders it back into
the history and `## Return of {id}`. Some checkpoints spell the section markers in the singular
(`<|tool_call_section_begin|>`). Also parsed, as the reference system does: Hermes `<tool_call>{"name": ...,
"arguments": ...}</tool_call>` and XML `<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>`
(one leading and one trailing newline of V trimmed, V JSON-decoded when it is JSON, else kept as a string).

Output is OpenAI delta dicts: `{"content": text}`, then for each call first
`{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]}` and then
`{"tool_calls": [{"index", "function": {"arguments": fragment}}]}` as the arguments are generated. A region that
does not parse (a call with its markers, or text inside a section) is logged and returned as content, never
dropped; the section markers themselves and whitespace between calls are layout.
"""
from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

from .markers import split_at_marker

log = logging.getLogger(__name__)

SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
TAG_BEGIN, TAG_END = "<tool_call>", "</tool_call>"
# what starts a tool-call region in ordinary text (a Kimi call is also accepted outside a section)
REGION_BEGIN = (*SECTION_BEGIN, CALL_BEGIN, TAG_BEGIN)

KIMI_ID = re.compile(r"(?:functions\.)?(?P<name>[^\s:<>|]+)(?::\w+)?")
MAX_HEADER = 512                  # characters between <|tool_call_begin|> and <|tool_call_argument_begin|>


class ToolCallParser:
    """Feed the content text as it is generated; get OpenAI deltas back.

    `validate_arguments=False` (streaming): a Kimi call's arguments stream as generated; arguments that turn out
    not to be JSON are logged but were already sent. `validate_arguments=True` (a whole response): each call is held
    until it ends, and one whose arguments are not JSON is returned as content instead."""

    # what each state waits for; a call also ends where the next one or the section's end starts
    MARKERS = {"text": REGION_BEGIN, "section": (CALL_BEGIN, *SECTION_END, *SECTION_BEGIN), "tag": (TAG_END,),
               "header": (ARGUMENT_BEGIN, CALL_END, CALL_BEGIN, *SECTION_END),
               "arguments": (CALL_END, CALL_BEGIN, *SECTION_END), "bad_call": (CALL_END, CALL_BEGIN, *SECTION_END)}

    def __init__(self, validate_arguments: bool = False):
        self.validate = validate_arguments
        self.state = "text"          # text | section | header | arguments | bad_call | tag
        self.in_section = False
        self.buffer = ""             # text not yet consumed (a tail that may be the start of a marker)
        self.region = ""             # raw text of the call region being read, for the content fallback
        self.header = ""             # id of the call being read
        self.name = ""               # its function name
        self.arguments = ""          # its arguments as generated so far
        self.sent = 0                # characters of the stripped arguments already streamed
        self.calls = 0               # tool calls emitted
        self.out: list[dict[str, Any]] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.buffer += text
        return self._run(final=False)

    def finish(self) -> list[dict[str, Any]]:
        """No more text will come: flush held text and close an unterminated region."""
        return self._run(final=True)

    # ---- the state machine -------------------------------------------------------------------------------------
    def _run(self, final: bool) -> list[dict[str, Any]]:
        while True:
            before, marker, rest = split_at_marker(self.buffer, self.MARKERS[self.state], final)
            self.buffer = rest
            getattr(self, "_" + self.state)(before, marker, final)
            if marker is None:
                break
        out, self.out = self.out, []
        return out

    def _text(self, before: str, marker: str | None, final: bool) -> None:
        if self.calls and not before.strip():
            # whitespace after a tool call is layout, not content; hold it until we know what follows
            if marker is None and not final:
                self.buffer = before + self.buffer
            before = ""
        self._content(before)
        if marker in SECTION_BEGIN:
            self.state, self.in_section = "section", True
        elif marker == CALL_BEGIN:
            self._begin_call()
        elif marker == TAG_BEGIN:
            self.state, self.region = "tag", marker

    def _section(self, before: str, marker: str | None, final: bool) -> None:
        if before.strip():
            self._unparsed(before, "text between tool calls")
        if marker == CALL_BEGIN:
            self._begin_call()
        elif marker in SECTION_END:
            self.state, self.in_section = "text", False

    def _header(self, before: str, marker: str | None, final: bool) -> None:
        self.header += before
        self.region += before
        if marker == ARGUMENT_BEGIN:
            self.region += marker
            match = KIMI_ID.fullmatch(self.header.strip())
            if match is None:
                self.state = "bad_call"
                return
            self.header, self.name, self.state = self.header.strip(), match["name"], "arguments"
            if not self.validate:
                self._emit_call_start()
        elif marker is not None or final or len(self.header) > MAX_HEADER:
            self.state = "bad_call"
            self._bad_call("", marker, final)

    def _arguments(self, before: str, marker: str | None, final: bool) -> None:
        self.arguments += before
        self.region += before
        if not self.validate:
            self._stream_arguments()
        if marker is None and not final:
            return
        arguments = self.arguments.strip()
        if not _is_json(arguments):
            if self.validate:
                self._unparsed(self.region + (marker if marker == CALL_END else ""), "arguments are not JSON")
                self._after_call(marker)
                return
            log.warning("tool call %s: the arguments are not JSON (already streamed): %r", self.header, arguments[:200])
        if self.validate:
            self._emit_call_start()
            self._emit_arguments(arguments)
        self.calls += 1
        self._after_call(marker)

    def _bad_call(self, before: str, marker: str | None, final: bool) -> None:
        self.region += before
        if marker is None and not final and len(self.region) <= MAX_HEADER:
            return
        self._unparsed(self.region + (marker if marker == CALL_END else ""), "malformed tool call")
        self._after_call(marker)

    def _tag(self, before: str, marker: str | None, final: bool) -> None:
        self.region += before + (marker or "")
        if marker is None and not final:
            return
        call = parse_tagged_call(self.region[len(TAG_BEGIN):].removesuffix(TAG_END).strip())
        if call is None:
            self._unparsed(self.region, "malformed <tool_call> region")
        else:
            self.header, self.name = f"functions.{call[0]}:{self.calls}", call[0]
            self._emit_call_start()
            self._emit_arguments(call[1])
            self.calls += 1
        self.state = "text"

    # ---- helpers ------------------------------------------------------------------------------------------------
    def _begin_call(self) -> None:
        self.state, self.region, self.header, self.arguments, self.sent = "header", CALL_BEGIN, "", "", 0

    def _after_call(self, marker: str | None) -> None:
        """Where a Kimi call region ended (its end marker, or the start of the next region)."""
        if marker == CALL_BEGIN:
            self._begin_call()
        elif marker in SECTION_END:
            self.state, self.in_section = "text", False
        else:
            self.state = "section" if self.in_section else "text"

    def _stream_arguments(self) -> None:
        """Send what is new of the stripped arguments (trailing whitespace is sent once more text follows it)."""
        text = self.arguments.strip()
        if len(text) > self.sent:
            self._emit_arguments(text[self.sent:])
            self.sent = len(text)

    def _emit_call_start(self) -> None:
        self._emit({"tool_calls": [{"index": self.calls, "id": self.header, "type": "function",
                                    "function": {"name": self.name, "arguments": ""}}]})

    def _emit_arguments(self, fragment: str) -> None:
        self._emit({"tool_calls": [{"index": self.calls, "function": {"arguments": fragment}}]})

    def _content(self, text: str) -> None:
        if text:
            self._emit({"content": text})

    def _unparsed(self, raw: str, why: str) -> None:
        log.warning("tool call did not parse (%s); returned as content: %r", why, raw[:200])
        self._content(raw)

    def _emit(self, delta: dict[str, Any]) -> None:
        """Append, merging into the previous delta of the same kind, so one feed gives few deltas."""
        last = self.out[-1] if self.out else None
        if last is not None and "content" in delta and "content" in last:
            last["content"] += delta["content"]
        elif (last is not None and "tool_calls" in delta and "tool_calls" in last and "id" not in last["tool_calls"][0]
              and last["tool_calls"][0]["index"] == delta["tool_calls"][0]["index"]):
            last["tool_calls"][0]["function"]["arguments"] += delta["tool_calls"][0]["function"]["arguments"]
        else:
            self.out.append(delta)


def parse_tagged_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of the body of a `<tool_call>` region: Hermes JSON or XML; None if it is neither."""
    if body.startswith("{"):
        try:
            call = _loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        arguments = arguments if isinstance(arguments, str) else _dumps(arguments)
        return (call["name"], arguments) if _has_utf8(call["name"] + arguments) else None
    match = re.fullmatch(r"<function=([^>\s]+)>(.*?)(?:</function>)?\s*", body, re.DOTALL)
    if match is None:
        return None
    parameters = re.compile(r"<parameter=([^>]+)>(.*?)</parameter>", re.DOTALL)
    if parameters.sub("", match[2]).strip():
        return None                  # text outside <parameter> elements: not a well-formed call
    arguments = {key: _xml_value(value) for key, value in parameters.findall(match[2])}
    return match[1], _dumps(arguments)


def _xml_value(text: str) -> Any:
    text = re.sub(r"\r?\n\Z", "", re.sub(r"\A\r?\n", "", text))
    try:
        return _loads(text)
    except json.JSONDecodeError:
        return text


def _is_json(text: str) -> bool:
    try:
        _loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _loads(text: str) -> Any:
    """json.loads of JSON proper: Python's also reads NaN, Infinity and 1e999 (as inf), which JSON has not; an
    integer of over 4,300 digits, which Python refuses (a ValueError), is not JSON here either."""
    try:
        return json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except json.JSONDecodeError:
        raise
    except ValueError as e:
        raise json.JSONDecodeError(str(e), text, 0) from None


def _not_json(word: str) -> Any:
    raise json.JSONDecodeError(f"{word} is not JSON", word, 0)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise json.JSONDecodeError(f"{text} is not a finite number", text, 0)
    return value


def _dumps(value: Any) -> str:
    """JSON text with non-ASCII characters as themselves, unless a string holds a lone surrogate (which a model
    can write as an escape, "\\ud800"): that has no UTF-8 form, so it stays escaped, or no response could be sent."""
    text = json.dumps(value, ensure_ascii=False)
    return text if _has_utf8(text) else json.dumps(value)


def _has_utf8(text: str) -> bool:
    """`text` can be sent: it holds no lone surrogate."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
