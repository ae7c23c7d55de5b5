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
    s = Server(str(tiny_dir), "--dtype", "float32", "--api-key", KEY, "--served-model-name", "tiny")
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
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, None, 400, "n", "not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, None, 400, "logprobs", "not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, None, 400,
     "response_format", "not supported"),
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
