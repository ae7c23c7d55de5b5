"""Tool calls, reasoning and forced tool choices end to end: the official openai client against a live server
(uvicorn on a local port, in this process, serving the default model, whose tokenizer has Kimi's special tokens).

A model that emits a given tool call: these tests script the sampler. A request whose seed is a key of SCRIPTS
samples those tokens in order instead of drawing; the hook is a monkeypatch of the Sampler class installed by the
`live` fixture alone, so nothing an HTTP client sends can reach it.
"""
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
import uvicorn

from deltaserve import LLM
from deltaserve.chat import ChatTemplate
from deltaserve.cli import DEFAULT_MODEL
from deltaserve.sampling import Sampler
from deltaserve.server import EngineThread, ServerState, create_app

OFFICIAL_TEMPLATE = Path(__file__).parent / "data" / "kimi_k2_instruct.jinja"
SCRIPTS: dict[int, list[int]] = {}          # seed -> the tokens a request with that seed samples
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"type": "integer", "minimum": 0,
                                                                          "maximum": 999}},
            "required": ["a", "b"], "additionalProperties": False}}},
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def live():
    """(base URL, the served LLM): a warm server whose sampler follows SCRIPTS."""
    patch = pytest.MonkeyPatch()
    real = Sampler.__call__

    def scripted(self, logits):
        script = SCRIPTS.get(self.params.seed)
        if script is None:
            return real(self, logits)
        self.step = getattr(self, "step", -1) + 1
        return script[self.step]
    patch.setattr(Sampler, "__call__", scripted)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                 # speed only: thread hand-offs crawl on a busy 2-core machine
    llm = LLM(DEFAULT_MODEL, dtype="float32")
    state = ServerState("kimi", llm=llm, runner=EngineThread(lambda: (llm.engine.warmup(), llm.engine)[1]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while not (server.started and state.ready) and time.time() < deadline:
        time.sleep(0.05)
    yield url, llm
    server.should_exit = True
    thread.join(10)
    state.runner.stop()
    torch.set_num_threads(threads)
    patch.undo()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live[0]}/v1", api_key="none", max_retries=0)


def script(llm, seed, *pieces):
    """Register the tokens of `pieces` (special-token names as their ids, other text as plain text) for `seed`;
    returns them."""
    tok = llm.tokenizer
    ids = []
    for piece in pieces:
        special = tok.token_id(piece)
        ids += [special] if special is not None else tok.encode_plain(piece)
    SCRIPTS[seed] = ids
    return ids


def weather_call(llm, seed):
    return script(llm, seed, "Let me check.", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                  "functions.get_weather:0", "<|tool_call_argument_begin|>", '{"city": "Paris"}', "<|tool_call_end|>",
                  "<|tool_calls_section_end|>", "<|im_end|>")


def tokenize(live, messages, tools=None):
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    return httpx.post(f"{live[0]}/tokenize", json=body, timeout=30).json()["tokens"]


def test_a_tool_call_comes_back_with_its_native_id_stream_and_not(live, client):
    weather_call(live[1], 101)
    r = client.chat.completions.create(model="kimi", messages=USER, tools=TOOLS, seed=101, max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert (call.id, call.type, call.function.name, call.function.arguments) == (
        "functions.get_weather:0", "function", "get_weather", '{"city": "Paris"}')
    chunks = list(client.chat.completions.create(model="kimi", messages=USER, tools=TOOLS, seed=101, max_tokens=64,
                                                 stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    parts = [part for c in chunks for part in c.choices[0].delta.tool_calls or []]
    assert content == "Let me check." and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert (parts[0].index, parts[0].id, parts[0].type, parts[0].function.name) == (
        0, "functions.get_weather:0", "function", "get_weather")
    assert all(p.id is None and p.index == 0 for p in parts[1:]) and len(parts) > 2     # arguments in fragments
    assert all(len(c.choices) == 1 for c in chunks)                 # each chunk carries the choice once
    assert "".join(p.function.arguments or "" for p in parts) == '{"city": "Paris"}'


def test_without_tools_or_with_tool_choice_none_the_call_is_text(live, client):
    weather_call(live[1], 102)
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        r = client.chat.completions.create(model="kimi", messages=USER, seed=102, max_tokens=64, **extra)
        message = r.choices[0].message
        assert message.tool_calls is None and r.choices[0].finish_reason == "stop"
        assert message.content == 'Let me check.functions.get_weather:0{"city": "Paris"}'


def test_a_tool_round_trip_renders_the_official_templates_ids(live, client):
    """request -> tool_calls -> tool result -> next request: the next prompt is exactly what Kimi's own
    chat_template.jinja renders (through the same sandbox), it starts with the first prompt and the tokens the
    model generated, and so the prefix cache serves all of them but the last."""
    llm = live[1]
    first_prompt = tokenize(live, USER, TOOLS)
    generated = weather_call(llm, 103)
    first = client.chat.completions.create(model="kimi", messages=USER, tools=TOOLS, seed=103, max_tokens=64)
    call = first.choices[0].message.tool_calls[0]
    messages = [*USER, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": '{"temp_c": 21}'}]
    script(llm, 104, "It is 21 degrees in Paris.", "<|im_end|>")
    second = client.chat.completions.create(model="kimi", messages=messages, tools=TOOLS, seed=104, max_tokens=64)
    assert second.choices[0].message.content == "It is 21 degrees in Paris."
    prompt = tokenize(live, messages, TOOLS)
    official = ChatTemplate(OFFICIAL_TEMPLATE.read_text()).render_ids(llm.tokenizer, messages, True, TOOLS)
    assert prompt == official and second.usage.prompt_tokens == len(prompt)
    assert prompt[:len(first_prompt) + len(generated)] == first_prompt + generated
    assert second.usage.prompt_tokens_details.cached_tokens == len(first_prompt) + len(generated) - 1


def test_tool_choice_named_and_required_are_enforced_by_the_grammar(client):
    """The model is free (not scripted): the grammar makes it call the tool, with arguments valid under the
    tool's parameters schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    named = client.chat.completions.create(model="kimi", messages=USER, tools=TOOLS, seed=7, max_tokens=300,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "add" and call.id.startswith("functions.add:")
    assert named.choices[0].finish_reason == "stop"               # a call forced by name: OpenAI's "stop"
    jsonschema.validate(json.loads(call.function.arguments), schemas["add"])
    required = client.chat.completions.create(model="kimi", messages=USER, tools=TOOLS, seed=8, max_tokens=300,
                                              tool_choice="required")
    calls = required.choices[0].message.tool_calls
    assert calls and required.choices[0].message.content is None
    assert required.choices[0].finish_reason == "tool_calls"
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_reasoning_is_routed_apart_and_markers_never_leak(live, client):
    """<think>...</think> (several plain tokens each here) goes to reasoning_content, stream and non-stream; no
    piece of a marker reaches content; with chat_template_kwargs thinking false everything is content."""
    text = "<think>Plan: look it up.</think>Sunny, 21 degrees."
    script(live[1], 105, text, "<|im_end|>")
    message = client.chat.completions.create(model="kimi", messages=USER, seed=105, max_tokens=64).choices[0].message
    assert (message.reasoning_content, message.content) == ("Plan: look it up.", "Sunny, 21 degrees.")
    chunks = list(client.chat.completions.create(model="kimi", messages=USER, seed=105, max_tokens=64, stream=True))
    contents = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    reasoning = [c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks]
    assert "".join(contents) == "Sunny, 21 degrees." and not any("<" in c or ">" in c for c in contents)
    assert "".join(reasoning) == "Plan: look it up."
    off = client.chat.completions.create(model="kimi", messages=USER, seed=105, max_tokens=64,
                                         extra_body={"chat_template_kwargs": {"thinking": False}})
    assert off.choices[0].message.content == text and off.choices[0].message.model_extra.get(
        "reasoning_content") is None
