"""Tool-call parsing: Kimi's section format as trained, Hermes and XML tags; whole responses and streams split
anywhere, malformed regions returned as content."""
import json
import logging
import random

import pytest

from deltaserve.chat_output import merge_deltas, parse_chat_output
from deltaserve.tool_parser import ToolCallParser

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def kimi_call(call_id: str, arguments: str) -> str:
    return f"{CB}{call_id}{AB}{arguments}{CE}"


def stream(text: str, cuts: list[int], validate: bool = False) -> list[dict]:
    """The deltas of `text` fed in pieces cut at `cuts`, then finished."""
    parser = ToolCallParser(validate_arguments=validate)
    bounds = [0, *sorted(cuts), len(text)]
    deltas = [d for a, b in zip(bounds, bounds[1:]) for d in parser.feed(text[a:b])]
    return deltas + parser.finish()


def test_kimi_call_gives_native_id_name_and_arguments_as_generated():
    args = '{"city": "Zürich", "days": [1, 2]}'
    message = parse_chat_output(f"Let me check.{SB}{kimi_call('functions.get_weather:0', args)}{SE}")
    assert message["content"] == "Let me check."
    assert message["tool_calls"] == [{"id": "functions.get_weather:0", "type": "function",
                                      "function": {"name": "get_weather", "arguments": args}}]


def test_several_kimi_calls_keep_their_order_and_ids():
    text = SB + kimi_call("functions.a:0", '{"x": 1}') + "\n" + kimi_call("functions.b:1", "{}") + SE
    calls = parse_chat_output(text)["tool_calls"]
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("functions.a:0", "a", '{"x": 1}'), ("functions.b:1", "b", "{}")]
    assert parse_chat_output(text)["content"] is None


def test_bare_id_and_singular_section_markers_are_accepted():
    text = "<|tool_call_section_begin|>" + kimi_call(" search:3 ", ' {"q": "x"} ') + "<|tool_call_section_end|>"
    [call] = parse_chat_output(text)["tool_calls"]
    assert (call["id"], call["function"]["name"], call["function"]["arguments"]) == ("search:3", "search", '{"q": "x"}')
    [call] = parse_chat_output("a " + kimi_call("functions.f:0", "[1]"))["tool_calls"]     # no section at all
    assert call["id"] == "functions.f:0" and call["function"]["arguments"] == "[1]"


def test_without_tools_the_markers_stay_content():
    text = "x" + SB + kimi_call("functions.f:0", "{}") + SE
    assert parse_chat_output(text, tools=False) == {"role": "assistant", "content": text}


def test_stream_sends_the_header_first_then_argument_fragments():
    args = '{"query": "weather in Paris", "limit": 3}'
    deltas = stream("Sure." + SB + kimi_call("functions.search:0", "\n " + args + " \n") + SE, list(range(1, 200, 3)))
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0] == {"index": 0, "id": "functions.search:0", "type": "function",
                        "function": {"name": "search", "arguments": ""}}
    fragments = [c["function"]["arguments"] for c in calls[1:]]
    assert len(fragments) > 3 and all("id" not in c for c in calls[1:])
    assert "".join(fragments) == args           # the JSON as generated, without the whitespace around it
    assert "".join(d.get("content", "") for d in deltas) == "Sure."


@pytest.mark.parametrize("seed", range(10))
def test_stream_split_anywhere_equals_the_whole_response(seed):
    rng = random.Random(seed)
    text = ("Checking both.\n" + SB + kimi_call("functions.a:0", '{"s": "<|not a marker"}') +
            kimi_call("functions.b:1", '{"n": [1, {"k": null}]}') + SE +
            '<tool_call>{"name": "c", "arguments": {"z": true}}</tool_call> done')
    cuts = rng.sample(range(1, len(text)), 25)
    deltas = stream(text, cuts)
    assert merge_deltas(deltas) == parse_chat_output(text)
    assert not any("<|" in d.get("content", "") for d in deltas)


def test_half_marker_is_held_back_until_it_resolves():
    parser = ToolCallParser()
    assert parser.feed("Hello <|tool_calls_sec") == [{"content": "Hello "}]
    assert parser.feed("tion_begin|>") == []
    parser = ToolCallParser()
    assert parser.feed("a <|tool") == [{"content": "a "}]
    assert parser.feed("box|> b") == [{"content": "<|toolbox|> b"}]
    assert parser.finish() == []


def test_bad_json_is_returned_as_content_and_logged(caplog):
    bad = kimi_call("functions.a:0", '{"x": ')
    text = "Hi" + SB + bad + kimi_call("functions.b:1", '{"ok": 1}') + SE
    with caplog.at_level(logging.WARNING, logger="deltaserve.tool_parser"):
        message = parse_chat_output(text)
    assert message["content"] == "Hi" + bad
    assert [(c["id"], c["function"]["arguments"]) for c in message["tool_calls"]] == [("functions.b:1", '{"ok": 1}')]
    assert "not JSON" in caplog.text


def test_unterminated_call_with_complete_json_is_a_call_and_truncated_one_is_content():
    complete = SB + CB + "functions.f:0" + AB + '{"a": 1}'
    assert parse_chat_output(complete)["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    truncated = "x" + SB + CB + "functions.f:0" + AB + '{"a": [1, 2'
    message = parse_chat_output(truncated)
    assert "tool_calls" not in message
    assert message["content"] == "x" + CB + "functions.f:0" + AB + '{"a": [1, 2'


def test_malformed_header_is_content():
    text = SB + CB + "functions.f:0" + CE + kimi_call("has space:0", "{}") + kimi_call("functions.g:1", "{}") + SE
    message = parse_chat_output(text)
    assert message["content"] == CB + "functions.f:0" + CE + kimi_call("has space:0", "{}")
    assert [c["id"] for c in message["tool_calls"]] == ["functions.g:1"]


def test_text_after_the_section_is_content_but_layout_whitespace_is_not():
    text = SB + kimi_call("functions.f:0", "{}") + SE + "\n\nAnything else?"
    assert parse_chat_output(text)["content"] == "\n\nAnything else?"
    assert parse_chat_output(SB + kimi_call("functions.f:0", "{}") + SE + "\n")["content"] is None


def test_hermes_call_serialises_arguments_and_keeps_a_string_verbatim():
    text = ('<tool_call>\n{"name": "f", "arguments": {"x": "é", "n": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": "raw text"}</tool_call>\n'
            '<tool_call>{"name": "h", "parameters": {"p": 1}}')
    calls = parse_chat_output(text)["tool_calls"]
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]) if i != 1 else
             c["function"]["arguments"]) for i, c in enumerate(calls)] == [
        ("functions.f:0", "f", {"x": "é", "n": 2}), ("functions.g:1", "g", "raw text"),
        ("functions.h:2", "h", {"p": 1})]
    assert parse_chat_output(text)["content"] is None


def test_xml_call_trims_one_newline_and_decodes_json_values():
    text = ("<tool_call>\n<function=run>\n<parameter=code>\nprint(1)\n\n</parameter>\n<parameter=n>\n5\n</parameter>"
            "<parameter=flags>[true, null]</parameter></function>\n</tool_call>")
    [call] = parse_chat_output(text)["tool_calls"]
    assert call["function"]["name"] == "run"
    assert json.loads(call["function"]["arguments"]) == {"code": "print(1)\n", "n": 5, "flags": [True, None]}


def test_lone_surrogates_in_tagged_arguments_stay_escaped():
    """A model can write a lone surrogate as a JSON escape; decoded, it has no UTF-8 form, so arguments holding one
    keep it escaped (the same JSON value), and the response can still be sent."""
    text = ('<tool_call>{"name": "f", "arguments": {"a": "\\ud800 é"}}</tool_call>'
            '<tool_call><function=g><parameter=b>"\\udc00"</parameter></function></tool_call>')
    message = parse_chat_output(text)
    json.dumps(message, ensure_ascii=False).encode()
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"a": "\ud800 é"},
                                                                                       {"b": "\udc00"}]


@pytest.mark.parametrize("body", ['{"arguments": {}}', "{not json}", "plain words",
                                  "<function=f><parameter=a>1</parameter> stray text</function>",
                                  '{"name": "\\ud800", "arguments": {}}', '{"name": "f", "arguments": {"a": NaN}}',
                                  '{"name": "f", "arguments": {"a": 1e999}}',
                                  '{"name": "f", "arguments": {"a": ' + "1" * 5000 + '}}'])
def test_malformed_tag_region_is_content(body, caplog):
    text = f"Before <tool_call>{body}</tool_call>"
    with caplog.at_level(logging.WARNING, logger="deltaserve.tool_parser"):
        message = parse_chat_output(text)
    assert message == {"role": "assistant", "content": text}
    assert "did not parse" in caplog.text


def test_plain_text_passes_through_unchanged():
    text = "No tools here: a < b, <b>bold</b>, and {\"json\": 1}."
    assert merge_deltas(stream(text, list(range(1, len(text)))))["content"] == text
    assert parse_chat_output(text) == {"role": "assistant", "content": text}
