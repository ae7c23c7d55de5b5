"""The chat page at GET /, driven in a real browser: Playwright steering Debian's chromium against a real server.

The replies of the tiny random model are real streams; the fields the server does not emit yet (reasoning_content,
tool_calls) and markup in model output are scripted streams handed to the page by Playwright's router, so the
page's rendering of every OpenAI stream field is checked now.
"""
import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from server_utils import Server

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed: run "
                                "`apt-get install -y chromium` (scripts/setup.sh does it when run as root)")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")

KEY = "sk-page"
CONTEXT = 1024
# Playwright adds --headless and a fresh --user-data-dir; the rest keep chromium off this machine's closed network.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
LOG_LINE = re.compile(r"/v1/chat/completions  --  in:\s+(\d+) \+\s+(\d+)  --.*gen:\s+(\d+) tok/s  --  out:\s+(\d+)")


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = Server(str(tiny_dir), "--dtype", "float32", "--api-key", KEY, "--served-model-name", "tiny",
               "--max-model-len", str(CONTEXT))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    """The page as a new user opens it: fresh storage, the API key typed into the settings, the model listed."""
    context = browser.new_context(viewport={"width": 900, "height": 700})
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda error: errors.append(error))
    page.goto(server.url + "/")
    page.click("#settings summary")
    set_field(page, "#api-key", KEY)
    sync_api.expect(page.locator("#model")).to_have_text("tiny")
    yield page
    context.close()
    assert not errors, errors


def set_field(page, selector: str, value: str) -> None:
    page.fill(selector, value)
    page.press(selector, "Tab")          # commits the value (a change event), as a user leaving the field does


def reply_settings(page, max_tokens: str, ignore_eos: bool = True) -> None:
    set_field(page, "#temperature", "0")
    set_field(page, "#max-tokens", max_tokens)
    page.set_checked("#ignore-eos", ignore_eos)


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def finished_turn(page, n: int):
    """The n-th turn (from 1), once its reply has ended."""
    sync_api.expect(page.locator("#send")).to_be_visible(timeout=60_000)
    return page.locator(".turn").nth(n - 1)


def logged_turns(server) -> list[tuple[int, ...]]:
    """(cached, new, gen tok/s, out) of each chat request, from the server's own log lines."""
    return [tuple(map(int, m.groups())) for m in LOG_LINE.finditer(server.stderr())]


def figures(turn) -> tuple[int, int, int, float]:
    m = re.fullmatch(r"in: (\d+) cached \+ (\d+) new · out: (\d+) · ([\d.]+) tok/s · first token [\d.]+ s · length",
                     turn.locator(".stats").text_content())
    assert m, turn.locator(".stats").text_content()
    return int(m[1]), int(m[2]), int(m[3]), float(m[4])


def test_reply_streams_in_with_the_servers_figures_and_text(page, server):
    # long enough that the page is seen between chunks: the tiny model makes 12 tokens in a few polls' time
    reply_settings(page, max_tokens="64")
    question = "Hello <b>there</b> & welcome"
    send(page, question)
    lengths = set()
    while page.locator("#stop").is_visible():
        lengths.add(page.evaluate("document.querySelector('.answer')?.textContent.length ?? 0"))
        time.sleep(0.01)
    assert len(lengths - {0}) >= 2, f"the reply did not grow while streaming: lengths seen {lengths}"
    turn = finished_turn(page, 1)
    cached, new, out, tok_s = figures(turn)
    log_cached, log_new, log_gen, log_out = logged_turns(server)[-1]
    assert (cached, new, out) == (log_cached, log_new, log_out) and out == 64
    assert log_gen / 4 <= tok_s <= log_gen * 4 + 4, (tok_s, log_gen)    # client-timed, so only roughly equal
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    expected = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=64,
        extra_body={"ignore_eos": True, "cache_salt": "fresh"}).choices[0].message.content
    assert turn.locator(".answer").text_content() == expected
    assert turn.locator(".user").text_content() == question


def test_second_turn_resends_the_reply_and_reuses_the_cached_prefix(page, server):
    reply_settings(page, max_tokens="6")
    send(page, "First question")
    first_reply = finished_turn(page, 1).locator(".answer").text_content()
    with page.expect_request("**/v1/chat/completions") as sent:
        send(page, "Second question")
    assert sent.value.post_data_json["messages"] == [
        {"role": "user", "content": "First question"}, {"role": "assistant", "content": first_reply},
        {"role": "user", "content": "Second question"}]
    cached, new, _, _ = figures(finished_turn(page, 2))
    assert cached > 0 and (cached, new) == logged_turns(server)[-1][:2]


def test_stop_aborts_the_request_and_the_server_frees_the_slot(page, server):
    disconnected = 'deltaserve_requests_total{outcome="client_disconnected"}'
    before = server.metric(disconnected)
    reply_settings(page, max_tokens="")                 # up to the whole context: minutes on this model
    send(page, "Tell me everything")
    page.locator(".answer").wait_for(state="attached", timeout=60_000)     # made by the first text
    assert server.metric("deltaserve_running_sequences") == 1
    page.click("#stop")
    turn = finished_turn(page, 1)
    sync_api.expect(turn.locator(".stats")).to_have_text(re.compile(r"stopped$"))
    sync_api.expect(page.locator("#stop")).to_be_hidden()
    deadline = time.time() + 15
    while server.metric("deltaserve_running_sequences") != 0 and time.time() < deadline:
        time.sleep(0.05)
    assert server.metric("deltaserve_running_sequences") == 0
    assert server.metric(disconnected) == before + 1


def test_a_refused_request_shows_the_servers_message_and_leaves_the_history(page, server):
    reply_settings(page, max_tokens="4")
    too_long = "x " * CONTEXT * 3
    send(page, too_long)
    refused = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                         json={"messages": [{"role": "user", "content": too_long.strip()}]})
    assert refused.status_code == 400
    turn = finished_turn(page, 1)
    sync_api.expect(turn.locator(".error")).to_have_text(f"HTTP 400: {refused.json()['error']['message']}")
    sync_api.expect(turn.locator(".user")).to_have_class(re.compile("unsent"))
    with page.expect_request("**/v1/chat/completions") as sent:
        send(page, "Shorter")
    assert sent.value.post_data_json["messages"] == [{"role": "user", "content": "Shorter"}]
    finished_turn(page, 2)


def sse(*events: dict) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def chunk(delta: dict, finish: str | None = None) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


MARKUP = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 1">'
ARGS = ['{"city": "<i onmouseover=', '\\"x\\">Paris</i>"}']
SCRIPTED = sse(
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning_content": "<b>plan</b>: "}), chunk({"reasoning_content": "look it up"}),
    chunk({"content": MARKUP}), chunk({"content": " " + "w" * 300}),
    chunk({"tool_calls": [{"index": 0, "id": "functions.get_weather:0", "type": "function",
                           "function": {"name": "get_weather", "arguments": ""}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": ARGS[0]}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": ARGS[1]}}]}, finish="tool_calls"),
    {"object": "chat.completion.chunk", "choices": [],
     "usage": {"prompt_tokens": 30, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 20}}})


def scripted(page, body: str, status: int = 200) -> list[dict]:
    """Answer the page's chat requests with `body`; returns the list their request bodies are appended to."""
    sent = []

    def answer(route):
        sent.append(route.request.post_data_json)
        route.fulfill(status=status, body=body, content_type="text/event-stream" if status == 200 else "application/json")
    page.route("**/v1/chat/completions", answer)
    return sent


def test_reasoning_tool_calls_and_markup_are_shown_as_text_and_resent(page):
    page.set_viewport_size({"width": 360, "height": 640})
    sent = scripted(page, SCRIPTED)
    send(page, "<b>weather?</b>")
    turn = finished_turn(page, 1)
    assert turn.locator(".user").text_content() == "<b>weather?</b>"
    assert turn.locator(".think .text").text_content() == "<b>plan</b>: look it up"
    assert turn.locator(".answer").text_content() == MARKUP + " " + "w" * 300
    assert turn.locator(".tool .name").text_content() == "get_weather"
    assert turn.locator(".tool .args").text_content() == "".join(ARGS)
    assert turn.locator(".stats").text_content().startswith("in: 20 cached + 10 new · out: 9 · ")
    assert page.locator("#chat script, #chat img, #chat b, #chat i").count() == 0
    assert page.evaluate("window.pwned") is None
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), "overflows a narrow window"
    send(page, "and tomorrow?")
    finished_turn(page, 2)
    assert sent[1]["messages"][1] == {
        "role": "assistant", "content": MARKUP + " " + "w" * 300, "reasoning_content": "<b>plan</b>: look it up",
        "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                        "function": {"name": "get_weather", "arguments": "".join(ARGS)}}]}


def test_an_error_event_mid_stream_is_shown_after_the_partial_reply(page):
    scripted(page, sse(chunk({"content": "partial"}), {"error": {"message": "internal error while generating x"}}))
    send(page, "hi")
    turn = finished_turn(page, 1)
    assert turn.locator(".answer").text_content() == "partial"
    sync_api.expect(turn.locator(".error")).to_have_text("internal error while generating x")


def test_enter_sends_but_not_with_shift_or_inside_an_ime_composition(page):
    sent = scripted(page, sse(chunk({"content": "ok"}), chunk({}, finish="stop")))
    page.click("#input")
    page.keyboard.type("line one")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("line two")
    page.dispatch_event("#input", "keydown", {"key": "Enter", "isComposing": True})
    assert page.locator(".turn").count() == 0 and page.input_value("#input") == "line one\nline two"
    page.keyboard.press("Enter")
    finished_turn(page, 1)
    assert sent[0]["messages"] == [{"role": "user", "content": "line one\nline two"}]
    assert page.input_value("#input") == ""


def test_settings_and_the_key_persist_across_a_reload(page):
    set_field(page, "#temperature", "0.3")
    page.reload()
    assert page.input_value("#temperature") == "0.3"
    sync_api.expect(page.locator("#model")).to_have_text("tiny")      # listed with the stored key


def test_its_security_policy_stops_markup_injected_into_the_page_from_running(page):
    blocked = page.evaluate("""() => new Promise(resolve => {
        document.addEventListener("securitypolicyviolation", e => resolve(e.effectiveDirective));
        setTimeout(() => resolve(null), 5000);
        document.getElementById("chat").innerHTML = '<img src="data:," onerror="window.pwned = 1">';
    })""")
    assert blocked == "script-src-attr" and page.evaluate("window.pwned") is None
