"""The OpenAI-compatible server, driven as users drive it: the official openai client, curl-like raw HTTP,
and a raw socket that hangs up mid-stream."""
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from deltaserve import LLM, SamplingParams
from deltaserve.server import EngineThread, ServerState, create_app

from server_utils import Server

KEY = "sk-test"


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = Server(str(tiny_dir), "--dtype", "float32", "--api-key", KEY, "--served-model-name", "tiny",
               env={"OMP_NUM_THREADS": "1"})        # speed only: torch's thread hand-offs crawl on a busy 2-core box
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_dir):
    return LLM(tiny_dir, dtype="float32")


def post(server, path, body, key=KEY, raw=None):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    return httpx.post(f"{server.url}{path}", content=raw if raw is not None else json.dumps(body), headers=headers,
                      timeout=30)


def test_health_is_503_until_the_model_is_warm():
    client = TestClient(create_app(ServerState("m")))
    assert client.get("/health").status_code == 503
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


def test_models_endpoint(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_non_stream(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
                                       temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_with_usage(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Stream please"}], max_tokens=10, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert len({c.id for c in chunks}) == 1


def test_completions_match_offline_generation(client, offline):
    ids = list(range(10, 90))
    expected = offline.generate([ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected.text and r.usage.completion_tokens == 12
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=ids, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert streamed == expected.text


def test_second_turn_reports_cached_tokens(client):
    messages = [{"role": "user", "content": "Tell me about delta rules."}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And more?"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


@pytest.mark.parametrize("body,raw,status,param,message", [
    (None, b"{not json", 400, None, "not valid JSON"),
    ({"messages": []}, None, 400, "messages", "at least 1 item"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, None, 400, "temperature",
     "valid number"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, None, 400, "max_tokens",
     "greater than or equal to 1"),
    ({"messages": [{"role": "user", "content": "x"}], "best_of": 2}, None, 400, "best_of", "not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "echo": True}, None, 400, "echo", "not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None, 400, "top_logprobs",
     "needs \"logprobs\": true"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "object", "properties": {"a": {"type": "integr"}}}}}}, None, 400,
     "response_format.json_schema.schema", "integr"),
    ({"messages": [{"role": "user", "content": "x"}], "guided_regex": "(unclosed"}, None, 400, "guided_regex",
     "unclosed"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, None, 400, "tool_choice.function.name",
     "'g' is not one of the tools"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"999999": 5}}, None, 400, "logit_bias",
     "token ids must lie in"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}}, None, 400, "messages",
     "'tools' is set by the request itself"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}, None, 400, "messages",
     "max_tokens is 5000: together"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, None, 404, "model", "does not exist"),
])
def test_bad_requests_get_openai_errors_and_change_nothing(server, client, body, raw, status, param, message):
    entries = server.metric("deltaserve_prefix_cache_entries")
    r = post(server, "/v1/chat/completions", body, raw=raw)
    assert r.status_code == status
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param and set(error) == {"message", "type", "param", "code"}
    assert server.metric("deltaserve_prefix_cache_entries") == entries
    ok = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "still ok?"}], max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_a_constraint_that_breaks_down_mid_output_is_the_clients_error(server, client):
    """A regex whose lexer gives up after its first token (a{1000000}: too many expressions) passes the compile-time
    check; it ends its request as a 400 naming the field (streamed: an error event of that type), not a 500."""
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "guided_regex": "a{1000000}"}
    r = post(server, "/v1/chat/completions", body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "guided_regex" and error["type"] == "invalid_request_error"
    assert "the constraint failed at output token 1: lexer error: too many expressions" in error["message"]
    events = post(server, "/v1/chat/completions", {**body, "stream": True}).text.split("\n\n")
    error = json.loads(next(e for e in events if '"error"' in e).removeprefix("data: "))["error"]
    assert error["param"] == "guided_regex" and error["type"] == "invalid_request_error"
    ok = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "still ok?"}], max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_prompt_longer_than_context_names_both_counts(server):
    r = post(server, "/v1/completions", {"prompt": list(range(5, 500)) * 9, "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "4455 tokens" in r.json()["error"]["message"] and "4096" in r.json()["error"]["message"]


def test_api_key_is_required(server):
    for key in (None, "wrong"):
        r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, key=key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401


def test_concurrent_streams_each_get_what_they_get_alone(client, offline):
    prompts = [list(range(20 + i, 60 + 3 * i)) for i in range(8)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    expected = [offline.generate([p], params)[0].text for p in prompts]
    results = [None] * 8

    def run(i):
        stream = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=10, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        results[i] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == expected


def test_client_disconnect_mid_stream_frees_the_sequence(server, client, offline):
    body = json.dumps({"prompt": list(range(30, 90)), "max_tokens": 3000, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
                 b"\r\n\r\n" + body)
    received = b""
    while received.count(b"data:") < 3:
        chunk = sock.recv(4096)
        assert chunk, f"the server closed the connection: {received!r}"
        received += chunk
    assert server.metric("deltaserve_running_sequences") == 1
    sock.close()
    deadline = time.time() + 10
    while server.metric("deltaserve_running_sequences") and time.time() < deadline:
        time.sleep(0.05)
    assert server.metric("deltaserve_running_sequences") == 0
    assert server.metric('deltaserve_requests_total{outcome="client_disconnected"}') >= 1
    ids = list(range(30, 90))
    expected = offline.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].text
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected


def test_full_queue_gets_503_and_queues_nothing(offline):
    """Deterministic: the engine thread is stopped, so a queued request stays queued."""
    state = ServerState("tiny", max_queued_requests=1, llm=offline, runner=EngineThread(lambda: offline.engine))
    state.runner.ready.wait(5)
    state.runner.stop()
    state.runner.thread.join(5)
    offline.engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    try:
        r = TestClient(create_app(state)).post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        assert len(offline.engine.waiting) == 1
    finally:
        offline.engine.waiting.clear()


def test_default_model_serves_without_arguments():
    server = Server()
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                  "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["model"] == "deltaserve-default"
    finally:
        err = server.stop()
    assert "/v1/chat/completions  --  in:" in err and "ready" in err


def test_bad_checkpoint_stops_the_server_with_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(RuntimeError, match="model_type: 'llama' is not supported"):
        Server(str(tmp_path))


# ---- the API's sampling, structured output and ops endpoints ------------------------------------------------

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 130}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", 7, None]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "maxItems": 2, "items": {
        "type": "string", "pattern": "^[a-z]{1,4}$"}}}, "required": ["ok", "tags"], "additionalProperties": False},
    {"anyOf": [{"type": "number", "minimum": -5, "maximum": 5}, {"const": "none"}]},
]


def test_json_schema_outputs_validate_and_free_requests_beside_them_are_unchanged(client, offline):
    """20 sampled json_schema requests (4 schemas) run concurrently with greedy free ones: every constrained output
    validates with jsonschema, and each free output is token for token what the model gives it alone."""
    import jsonschema
    free = [list(range(40 + 7 * i, 90 + 7 * i)) for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [offline.generate([p], params)[0].text for p in free]
    results = {}

    def constrained(i):
        schema = SCHEMAS[i % len(SCHEMAS)]
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Give me JSON number {i}"}], max_tokens=600,
            temperature=1.0, seed=i, response_format={"type": "json_schema", "json_schema": {
                "name": f"s{i % len(SCHEMAS)}", "schema": schema, "strict": True}})
        results[i] = (schema, r.choices[0])

    def unconstrained(i):
        results[f"free{i}"] = client.completions.create(model="tiny", prompt=free[i], max_tokens=12, temperature=0,
                                                        extra_body={"ignore_eos": True}).choices[0].text
    threads = [threading.Thread(target=constrained, args=(i,)) for i in range(20)]
    threads += [threading.Thread(target=unconstrained, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i in range(20):
        schema, choice = results[i]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert [results[f"free{i}"] for i in range(4)] == alone


def test_logprobs_are_the_models_log_softmax_in_both_shapes(server, client, offline):
    """Completions (legacy shape, echo) and chat (logprobs.content): each token's log-probability and the top
    alternatives equal log_softmax of LLM.logits at that position, within 1e-5. The prompt spans two prefill chunks,
    holds a special token and is already cached; both choices of n=2 show the prompt's scores."""
    import torch
    ids = list(range(100, 330)) + [482] + list(range(330, 400))
    client.completions.create(model="tiny", prompt=ids, max_tokens=1)
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, logprobs=3, echo=True, n=2,
                                  extra_body={"ignore_eos": True})
    logprobs, second = r.choices[0].logprobs, r.choices[1].logprobs
    assert second.token_logprobs[:len(ids)] == logprobs.token_logprobs[:len(ids)]
    assert second.top_logprobs[:len(ids)] == logprobs.top_logprobs[:len(ids)]
    out = offline.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    tokenizer = offline.tokenizer
    reference = torch.log_softmax(offline.logits(ids + out.token_ids).double(), -1)
    tokens = ids + out.token_ids
    assert r.choices[0].text == tokenizer.decode(ids, skip_special_tokens=False) + out.text
    assert "<|im_end|>" in r.choices[0].text
    assert logprobs.tokens == [tokenizer.token_bytes(t).decode(errors="replace") for t in tokens]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(tokens))]
    for position in range(1, len(tokens)):
        assert abs(logprobs.token_logprobs[position] - reference[position - 1, tokens[position]]) <= 1e-5
        top = reference[position - 1].topk(3)
        expected = {tokenizer.token_bytes(t).decode(errors="replace"): v for t, v in
                    zip(top.indices.tolist(), top.values.tolist())}
        assert set(expected) <= set(logprobs.top_logprobs[position])
        assert all(abs(logprobs.top_logprobs[position][k] - v) <= 1e-5 for k, v in expected.items())
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    prompt = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
    content = chat.choices[0].logprobs.content
    generated = offline.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0].token_ids
    reference = torch.log_softmax(offline.logits(prompt + generated).double(), -1)
    for i, (entry, token) in enumerate(zip(content, generated)):
        assert entry.bytes == list(tokenizer.token_bytes(token)) and len(entry.top_logprobs) == 2
        assert abs(entry.logprob - reference[len(prompt) - 1 + i, token]) <= 1e-5


def test_penalties_bias_and_min_p_are_honoured_as_offline(client, offline):
    ids = list(range(30, 70))
    fields = {"frequency_penalty": 0.8, "presence_penalty": 0.4, "repetition_penalty": 1.3, "min_p": 0.05,
              "logit_bias": {str(ids[0]): 3.0}}
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, frequency_penalty=0.8, presence_penalty=0.4,
                            repetition_penalty=1.3, min_p=0.05, logit_bias={ids[0]: 3.0})
    expected = offline.generate([ids], params)[0].text
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True, **fields})
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected != plain.choices[0].text


def test_list_prompts_and_n_choices_share_each_prompts_prefill(server, client, offline):
    """Two prompts x n=2: four choices in prompt-major order, each prompt prefilled once (the second choice of each
    starts from the first's snapshot, as the vllm: prefix-cache counters show)."""
    prompts = [list(range(200, 260)), list(range(300, 340))]
    hits = lambda: server.metric('vllm:prefix_cache_hits_total{model_name="tiny"}')
    before = hits()
    r = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True, "cache_salt": "list-prompts"})
    expected = [offline.generate([p], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].text
                for p in prompts]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [expected[0], expected[0], expected[1], expected[1]]
    assert hits() - before == 60 + 40
    assert r.usage.prompt_tokens == 100 and r.usage.completion_tokens == 24


def test_a_refused_prompt_of_a_list_queues_none_of_them(server, client):
    """All prompts are checked before any is queued: the good one never starts (no prefix-cache lookup)."""
    queries = lambda: server.metric('vllm:prefix_cache_queries_total{model_name="tiny"}')
    before = queries()
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt=[[5, 6, 7], [7] * 4096], max_tokens=4)
    time.sleep(0.5)
    assert queries() == before
    assert client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2).choices[0].finish_reason


def test_tokenize_detokenize_version_and_vllm_metric_names(server, client):
    messages = [{"role": "user", "content": "Tokens please"}]
    chat = post(server, "/tokenize", {"messages": messages}).json()
    served = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert chat["count"] == len(chat["tokens"]) == served.usage.prompt_tokens and chat["max_model_len"] == 4096
    raw = post(server, "/tokenize", {"prompt": "a<|im_end|>b"}).json()
    assert raw["count"] == 3 and raw["tokens"][1] == 482
    assert post(server, "/detokenize", {"tokens": raw["tokens"]}).json() == {"prompt": "a<|im_end|>b"}
    assert post(server, "/tokenize", {"prompt": "x", "messages": messages}).status_code == 400
    assert post(server, "/detokenize", {"tokens": [10 ** 6]}).json()["error"]["param"] == "tokens"
    assert httpx.get(f"{server.url}/version", headers={"Authorization": f"Bearer {KEY}"}).json()["version"]
    for path in ("/tokenize", "/detokenize"):
        assert post(server, path, {"prompt": "x", "tokens": [1]}, key=None).status_code == 401
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count"):
        assert f'{name}{{model_name="tiny"}} ' in text, name


def test_streamed_choices_carry_their_index_text_and_logprobs(client):
    """n=2 streams: each index's deltas and log-probabilities add up to its non-streamed choice."""
    chat = dict(model="tiny", messages=[{"role": "user", "content": "Two please"}], max_tokens=6, temperature=0,
                n=2, logprobs=True, top_logprobs=1, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**chat)
    chunks = list(client.chat.completions.create(**chat, stream=True))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        streamed = [e for c in mine if c.logprobs for e in c.logprobs.content]
        assert [e.token for e in streamed] == [e.token for e in choice.logprobs.content]
        assert all(abs(a.logprob - b.logprob) <= 1e-5 for a, b in zip(streamed, choice.logprobs.content))
        assert mine[-1].finish_reason == "length" and len(streamed) == 6
    legacy = dict(model="tiny", prompt=list(range(50, 70)), max_tokens=5, temperature=0, echo=True, logprobs=2,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**legacy).choices[0]
    parts = [c.choices[0] for c in client.completions.create(**legacy, stream=True)]
    assert "".join(p.text for p in parts) == whole.text and parts[-1].finish_reason == "length"
    for field in ("tokens", "text_offset"):
        assert [x for p in parts for x in getattr(p.logprobs, field)] == getattr(whole.logprobs, field)
    streamed, expected = [x for p in parts for x in p.logprobs.token_logprobs], whole.logprobs.token_logprobs
    assert streamed[0] is None and max(abs(a - b) for a, b in zip(streamed[1:], expected[1:])) <= 1e-5
