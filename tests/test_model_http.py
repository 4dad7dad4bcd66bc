"""The turn's direct Chat Completions request (conversations.chat_model.http): the same outcome as
the SDK's for every answer a model endpoint gives, a keep-alive connection per thread that is
replaced when the server has closed it or it sat idle too long, and the SDK when a proxy applies. No
database, no Django."""

import json
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from conversations.chat_model import http as model_http
from conversations.chat_model.contract import ChatCompletion, ModelError
from conversations.chat_model.openai_backend import OpenAIChatModel
from conversations.chat_model.transport import make_openai_client
from tests.test_summarizers import (
    API_KEY,
    RATE_LIMITED,
    SERVER_ERROR,
    Reply,
    ScriptedServer,
    chat_reply,
    error_reply,
    server_fixture,  # noqa: F401  (the "server" fixture)
)

MESSAGES = [{"role": "user", "content": "How long should I practise?"}]

TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "metronome", "arguments": '{"bpm": 60}'},
}


def tool_call_reply() -> Reply:
    reply = chat_reply(None, finish_reason="tool_calls")
    assert reply.body is not None
    reply.body["choices"][0]["message"]["tool_calls"] = [{**TOOL_CALL, "extra": None}]
    return reply


def body_reply(body: dict[str, Any]) -> Reply:
    return Reply(body=body)


ANSWERS = {
    "reply": chat_reply("Twenty minutes a day.", usage=(31, 6)),
    "cut by length": chat_reply("Twenty minutes a", finish_reason="length"),
    "refusal": chat_reply(None, refusal="I can't help with that."),
    "no usage": chat_reply("Twenty minutes.", usage=None),
    "tool call": tool_call_reply(),
    "empty": chat_reply(""),
    "content filter": chat_reply(None, finish_reason="content_filter"),
    "no choices": body_reply({"id": "x", "object": "chat.completion", "choices": []}),
    "server error": SERVER_ERROR,
    "rate limited": RATE_LIMITED,
    "not found": error_reply(404, "The model does not exist", "invalid_request_error"),
    "timeout status": error_reply(408, "Request timed out", "timeout", code="timeout"),
    "unauthorized": error_reply(401, f"Incorrect API key provided: {API_KEY}", "invalid"),
}


def outcome(model: OpenAIChatModel) -> ChatCompletion | tuple[int, str]:
    try:
        return model.complete(MESSAGES, "gpt-test")
    except ModelError as error:
        return (error.status, str(error))


@pytest.mark.parametrize("answer", list(ANSWERS))
def test_the_direct_request_ends_as_the_sdks_does(server: ScriptedServer, answer: str) -> None:
    client = make_openai_client(server.base_url, API_KEY, timeout=5.0)
    direct = OpenAIChatModel(client, timeout=5.0)
    through_sdk = OpenAIChatModel(client, timeout=5.0, direct=False)
    assert direct.direct is not None and through_sdk.direct is None
    server.script(ANSWERS[answer], ANSWERS[answer])
    ours, sdks = outcome(direct), outcome(through_sdk)
    assert ours == sdks
    sent_direct, sent_by_sdk = server.requests
    assert sent_direct.body == sent_by_sdk.body
    assert sent_direct.path == sent_by_sdk.path == "/v1/chat/completions"


def test_a_tool_call_is_stored_without_null_fields(server: ScriptedServer) -> None:
    server.script(tool_call_reply())
    client = make_openai_client(server.base_url, API_KEY, timeout=5.0)
    completion = OpenAIChatModel(client, timeout=5.0).complete(MESSAGES, "m")
    assert completion.tool_calls == (TOOL_CALL,)


def test_the_turn_does_not_go_through_the_sdk(
    server: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = make_openai_client(server.base_url, API_KEY, timeout=5.0)
    model = OpenAIChatModel(client, timeout=5.0)

    def sdk_post(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the SDK sent the request")

    monkeypatch.setattr(client, "post", sdk_post)
    server.script(chat_reply("Direct."))
    assert model.complete(MESSAGES, "m").content == "Direct."


@pytest.mark.parametrize(
    ("environment", "direct"),
    [
        ({"HTTP_PROXY": "http://proxy.internal:3128"}, False),
        ({"ALL_PROXY": "http://proxy.internal:3128"}, False),
        ({"HTTP_PROXY": "http://proxy.internal:3128", "NO_PROXY": "127.0.0.1"}, True),
        ({"HTTPS_PROXY": "http://proxy.internal:3128"}, True),  # the endpoint is http://
    ],
)
def test_a_proxy_for_the_endpoint_leaves_the_request_to_the_sdk(
    server: ScriptedServer,
    monkeypatch: pytest.MonkeyPatch,
    environment: dict[str, str],
    direct: bool,
) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    client = make_openai_client(server.base_url, API_KEY, timeout=5.0)
    assert (OpenAIChatModel(client, timeout=5.0).direct is not None) is direct


def test_organization_and_project_are_sent_as_the_sdk_sends_them(server: ScriptedServer) -> None:
    client = make_openai_client(server.base_url, API_KEY, timeout=5.0).with_options(
        organization="org-1", project="proj-1"
    )
    server.script(chat_reply("Yes."), chat_reply("Yes."))
    OpenAIChatModel(client, timeout=5.0).complete(MESSAGES, "m")
    OpenAIChatModel(client, timeout=5.0, direct=False).complete(MESSAGES, "m")
    ours, sdks = server.requests
    for header in ("authorization", "openai-organization", "openai-project", "content-type"):
        assert ours.headers[header] == sdks.headers[header], header


def test_an_https_endpoint_verifies_its_certificate() -> None:
    direct = model_http.DirectChatCompletions("https://api.example.com/v1", {}, 5.0)
    assert direct.ssl_context is not None
    assert direct.ssl_context.verify_mode == ssl.CERT_REQUIRED
    assert direct.ssl_context.check_hostname
    where = (direct.host, direct.port, direct.path)
    assert where == ("api.example.com", 443, "/v1/chat/completions")


# ---------------------------------------------------------------------------------------------
# Keep-alive connections against an HTTP/1.1 server that can drop a connection after answering


class KeepAliveServer:
    """Answers every POST with a chat reply over HTTP/1.1 keep-alive, recording the client's
    port of each request (one port per connection). ``close_after_answer``: the server closes
    the connection after answering without saying so (as a server whose idle timeout passed)."""

    def __init__(self) -> None:
        self.ports: list[int] = []
        self.close_after_answer = False
        self.raw_body: bytes | None = None
        self.closed = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                owner.ports.append(self.client_address[1])
                reply = chat_reply("Kept alive.").body
                payload = owner.raw_body or json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                self.close_connection = owner.close_after_answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def shutdown_request(self, request: Any) -> None:
                super().shutdown_request(request)
                owner.closed.set()

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"


@pytest.fixture(name="keep_alive")
def keep_alive_fixture() -> Iterator[KeepAliveServer]:
    server = KeepAliveServer()
    thread = threading.Thread(target=server.httpd.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


def direct_to(server: KeepAliveServer) -> model_http.DirectChatCompletions:
    return model_http.DirectChatCompletions(server.base_url, {}, timeout=5.0)


def test_a_thread_reuses_its_connection(keep_alive: KeepAliveServer) -> None:
    direct = direct_to(keep_alive)
    for _ in range(3):
        direct.create({"model": "m", "messages": MESSAGES})
    assert len(keep_alive.ports) == 3
    assert len(set(keep_alive.ports)) == 1


def test_a_connection_the_server_closed_is_replaced(keep_alive: KeepAliveServer) -> None:
    direct = direct_to(keep_alive)
    keep_alive.close_after_answer = True
    direct.create({"model": "m", "messages": MESSAGES})
    assert keep_alive.closed.wait(5), "the server did not close the connection"
    keep_alive.close_after_answer = False
    answer = direct.create({"model": "m", "messages": MESSAGES})
    assert answer["choices"][0]["message"]["content"] == "Kept alive."
    assert len(set(keep_alive.ports)) == 2


def test_an_idle_connection_past_the_keepalive_expiry_is_replaced(
    keep_alive: KeepAliveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    direct = direct_to(keep_alive)
    monkeypatch.setattr(model_http, "KEEPALIVE_EXPIRY_SECONDS", -1.0)  # every reuse is too late
    direct.create({"model": "m", "messages": MESSAGES})
    direct.create({"model": "m", "messages": MESSAGES})
    assert len(set(keep_alive.ports)) == 2


def test_each_thread_has_its_own_connection(keep_alive: KeepAliveServer) -> None:
    direct = direct_to(keep_alive)
    threads, calls = 4, 3
    together = threading.Barrier(threads)
    failures: list[BaseException] = []

    def run() -> None:
        try:
            together.wait(5)  # all alive at once: no thread can inherit another's connection
            for _ in range(calls):
                direct.create({"model": "m", "messages": MESSAGES})
            together.wait(5)
        except BaseException as error:  # reported below, with the thread's own traceback
            failures.append(error)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(10)
    assert not failures
    assert len(keep_alive.ports) == threads * calls
    assert len(set(keep_alive.ports)) == threads


def test_a_2xx_answer_that_is_not_json_is_a_502(keep_alive: KeepAliveServer) -> None:
    keep_alive.raw_body = b"<html>gateway</html>"
    client = make_openai_client(keep_alive.base_url, API_KEY, timeout=5.0)
    for model in (OpenAIChatModel(client, 5.0), OpenAIChatModel(client, 5.0, direct=False)):
        with pytest.raises(ModelError) as caught:
            model.complete(MESSAGES, "m")
        assert caught.value.status == 502
        assert str(caught.value) == "The model endpoint returned an invalid response."


def test_the_log_of_a_refused_key_does_not_carry_the_key(
    server: ScriptedServer, caplog: pytest.LogCaptureFixture
) -> None:
    server.script(error_reply(401, f"Incorrect API key provided: {API_KEY}", "invalid"))
    client = make_openai_client(server.base_url, API_KEY, timeout=5.0)
    with pytest.raises(ModelError):
        OpenAIChatModel(client, timeout=5.0).complete(MESSAGES, "m")
    assert "HTTP 401" in caplog.text
    assert API_KEY not in caplog.text
    assert "[redacted]" in caplog.text
