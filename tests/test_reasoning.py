"""Reasoning routing: <think> (Kimi K2 family) and XTML channels (Kimi K3) into reasoning_content / content, start
state from the prompt, streams split anywhere, and composition with the tool parser."""
import pytest

from deltaserve.chat_output import ChatOutputParser, merge_deltas, parse_chat_output
from deltaserve.reasoning import REASONING_PARSERS, KimiK2Reasoning, KimiK3Reasoning, make_reasoning_parser
from deltaserve.tool_parser import ToolCallParser

K2_PROMPT = "<|im_assistant|>assistant<|im_middle|>"
K3_PROMPT = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
MARKERS = ["<think>", "</think>", "<|open|>", "<|close|>", "<|sep|>", "<|tool_calls_section_begin|>"]


def route(parser, text: str, step: int) -> list[dict]:
    deltas = [d for i in range(0, len(text), step) for d in parser.feed(text[i:i + step])]
    return deltas + parser.finish()


def fields(deltas: list[dict]) -> tuple[str, str]:
    return "".join(d.get("reasoning_content", "") for d in deltas), "".join(d.get("content", "") for d in deltas)


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_k2_prompt_ending_in_think_starts_in_reasoning(step):
    deltas = route(KimiK2Reasoning(K2_PROMPT + "<think>"), "Let me see.\n</think>\n\nThe answer is 4.", step)
    assert fields(deltas) == ("Let me see.\n", "\n\nThe answer is 4.")
    for d in deltas:
        assert not any(m[:k] in "".join(d.values()) for m in MARKERS for k in range(2, len(m) + 1))


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_k2_output_opening_think_is_reasoning_and_other_output_is_content(step):
    assert fields(route(KimiK2Reasoning(K2_PROMPT), "\n<think>hmm</think>ok", step)) == ("hmm", "ok")
    assert fields(route(KimiK2Reasoning(K2_PROMPT), "Plain answer, then <think> as text", step)) == (
        "", "Plain answer, then <think> as text")
    assert fields(route(KimiK2Reasoning(K2_PROMPT), "<thin", step)) == ("", "<thin")


def test_k2_unterminated_reasoning_stays_reasoning():
    assert fields(route(KimiK2Reasoning("<think>"), "still thinking </thi", 4)) == ("still thinking </thi", "")


@pytest.mark.parametrize("step", [1, 7, 1000])
def test_k2_reasoning_ends_at_a_tool_section_which_the_tool_parser_reads(step):
    text = ("I need the weather.<|tool_calls_section_begin|><|tool_call_begin|>functions.weather:0"
            '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>')
    parser = ChatOutputParser(KimiK2Reasoning("<think>"), ToolCallParser())
    deltas = route(parser, text, step)
    message = merge_deltas(deltas)
    assert message["reasoning_content"] == "I need the weather."
    assert message["content"] is None
    assert message["tool_calls"][0]["id"] == "functions.weather:0"
    assert parser.tool_calls == 1
    assert message == parse_chat_output(text, KimiK2Reasoning("<think>"))


def test_k2_tool_markers_inside_closed_reasoning_are_content_afterwards_only():
    text = "think <tool_call>x</tool_call></think>Answer"
    assert parse_chat_output(text, KimiK2Reasoning("<think>")) == {
        "role": "assistant", "content": "Answer", "reasoning_content": "think <tool_call>x</tool_call>"}


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_k3_channels_route_and_wrappers_are_dropped(step):
    text = ("Compare the two.<|close|>think<|sep|>\n<|open|>response<|sep|>The first.<|close|>response<|sep|>"
            "<|close|>message<|sep|>")
    deltas = route(KimiK3Reasoning(K3_PROMPT), text, step)
    assert fields(deltas) == ("Compare the two.", "The first.")
    assert not any("<|" in v or "|>" in v for d in deltas for v in d.values())


def test_k3_output_opening_its_channels_itself():
    text = "<|open|>think<|sep|>a<|close|>think<|sep|><|open|>response<|sep|>b<|close|>response<|sep|>"
    assert fields(route(KimiK3Reasoning('<|open|>message role="assistant"<|sep|>'), text, 3)) == ("a", "b")
    assert fields(route(KimiK3Reasoning('<|open|>response<|sep|>'), "only b<|close|>response<|sep|>", 3)) == (
        "", "only b")


def test_k3_text_outside_any_channel_is_kept_as_content():
    text = "r<|close|>think<|sep|>stray<|open|>response<|sep|>b<|close|>response<|sep|>tail"
    assert fields(route(KimiK3Reasoning(K3_PROMPT), text, 2)) == ("r", "strayb" + "tail")


def test_registry_and_start_state_from_the_prompt():
    assert set(REASONING_PARSERS) == {"kimi_k2", "kimi_k3", "none"}
    assert isinstance(make_reasoning_parser("auto", K3_PROMPT), KimiK3Reasoning)
    assert isinstance(make_reasoning_parser("auto", K2_PROMPT), KimiK2Reasoning)
    assert make_reasoning_parser("kimi_k3", K3_PROMPT).in_reasoning
    assert not make_reasoning_parser("kimi_k2", K2_PROMPT).in_reasoning
    assert make_reasoning_parser("kimi_k2", K2_PROMPT + "<think>").in_reasoning
    assert fields(route(make_reasoning_parser("none", "<think>"), "a</think>b", 1)) == ("", "a</think>b")
    no_thinking = make_reasoning_parser("kimi_k2", "<think>", {"thinking": False})
    assert fields(route(no_thinking, "<think>a</think>b", 2)) == ("", "<think>a</think>b")
    with pytest.raises(ValueError, match="kimi_k2"):
        make_reasoning_parser("deepseek_r1", K2_PROMPT)
