"""``FakeOpenAI``: the handle tests and benchmarks start the fake server with."""

from __future__ import annotations

import contextlib
import inspect
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from tests.support.fake_openai.bodies import (
    PrefixCache,
    chat_completion_body,
    chunk_body,
    responses_body,
    stream_deltas,
    usage_body,
)
from tests.support.fake_openai.faults import FaultPlan, RecordedRequest, Recorder
from tests.support.fake_openai.handler import FakeHTTPServer, Handler
from tests.support.fake_openai.replies import (
    BOTH_LIMITS_MESSAGE,
    LIMIT_MODES,
    RUNAWAY_TOKENS,
    Reply,
    apply_answer_fault,
    apply_limit_mode,
    chat_reply_text,
    refuses_both_limits,
    summary_text,
)
from tests.support.fake_openai.wire import (
    DEFAULT_MODELS,
    HTTP_FAULTS,
    LLAMA_CPP_CONTEXT_ERROR,
    approx_tokens,
    chatml_prompt_tokens,
    classify,
    requested_tool,
)

# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------


class FakeOpenAI:
    """A fake OpenAI-compatible server on a background thread.

    Runtime knobs are plain attributes, safe to assign while serving: ``latency`` (seconds before
    answering a chat request), ``summarize_latency``, ``timeout_sleep`` (the "timeout" fault),
    ``chunk_delay`` (seconds between streamed chunks), ``reply_words`` (pad chat replies to this
    many words), ``reply_fn`` (``request_json -> str`` overriding chat replies), ``summary_fn``
    (the same for summaries), ``summary_cap_words``, ``summary_habits`` (SUMMARY_HABITS),
    ``api_key``, ``models``, ``limit_mode`` and ``runaway_tokens`` (LIMIT_MODES).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        latency: float = 0.0,
        summarize_latency: float = 0.0,
        api_key: str | None = None,
        models: Iterable[str] = DEFAULT_MODELS,
        reply_fn: Callable[[dict[str, Any]], str] | None = None,
        summary_fn: Callable[[dict[str, Any]], str] | None = None,
        reply_words: int | None = None,
        summary_cap_words: int = 300,
        summary_habits: Iterable[str] = (),
        timeout_sleep: float = 2.0,
        chunk_delay: float = 0.0,
        fault_rate: float = 0.0,
        faults: Iterable[str] = (),
        fault_kind: str = "any",
        seed: int | None = 1,
        limit_mode: str | None = None,
        runaway_tokens: int = RUNAWAY_TOKENS,
        prompt_counter: Callable[[str], int] | None = None,
        context_window: int | None = None,
    ) -> None:
        if limit_mode is not None and limit_mode not in LIMIT_MODES:
            raise ValueError(f"limit_mode must be one of {sorted(LIMIT_MODES)} or None")
        self.limit_mode, self.runaway_tokens = limit_mode, runaway_tokens
        self.host, self.port = host, port
        self.latency, self.summarize_latency = latency, summarize_latency
        self.api_key = api_key
        self.models = tuple(models)
        self.reply_fn, self.summary_fn = reply_fn, summary_fn
        self.reply_words = reply_words
        self.summary_cap_words = summary_cap_words
        self.summary_habits = tuple(summary_habits)
        self.timeout_sleep = timeout_sleep
        self.chunk_delay = chunk_delay
        self.prompt_counter, self.context_window = prompt_counter, context_window
        self.prompt_sizes: list[int] = []  # chat prompts counted with prompt_counter
        self._faults = FaultPlan()
        self._recorder = Recorder()
        self.cache = PrefixCache()  # reports cached prompt tokens by OpenAI's rule
        # Request parameters answered with a 400, as a server that does not know them does.
        self.refused_params: tuple[str, ...] = ()
        if fault_rate or faults:
            self.set_faults(fault_kind, fault_rate, list(faults), seed)
        self._stopping = threading.Event()  # wakes every latency/timeout wait at shutdown
        self._httpd: FakeHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("FakeOpenAI is not started; call start() or use it as a context")
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        return f"http://{host}:{self._httpd.server_address[1]}/v1"

    def start(self) -> FakeOpenAI:
        if self._httpd is not None:
            return self
        self._stopping.clear()
        self._httpd = FakeHTTPServer((self.host, self.port), self)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="fake-openai",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        self._stopping.set()
        httpd.shutdown()
        self._close_connections()  # keep-alive handler threads would otherwise idle on
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeOpenAI:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _track_connection(self, connection: socket.socket) -> None:
        with self._connections_lock:
            self._connections.add(connection)

    def _untrack_connection(self, connection: socket.socket) -> None:
        with self._connections_lock:
            self._connections.discard(connection)

    def _close_connections(self) -> None:
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):  # already closed by the client
                connection.shutdown(socket.SHUT_RDWR)

    # -- recording ---------------------------------------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        """A copy of every recorded request, oldest first."""
        return self._recorder.records()

    def chat_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.kind == "chat"]

    def summarize_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.kind == "summarize"]

    def counters(self) -> dict[str, Any]:
        """``total``, ``chat``, ``summarize``, ``faults`` (name -> count), ``in_flight``,
        ``max_in_flight`` (the most requests being answered at once)."""
        return self._recorder.counters()

    def reset(self) -> None:
        """Forget recorded requests and counters (reply numbers restart at #1). Faults stay
        configured; see clear_faults()."""
        self._recorder.reset()

    def wait_for(self, predicate: Callable[..., Any], timeout: float = 5.0) -> bool:
        """Poll ``predicate()`` (or ``predicate(server)``) until it is truthy or ``timeout``
        seconds pass; returns whether it became truthy."""
        arguments = () if _takes_no_arguments(predicate) else (self,)
        deadline = time.monotonic() + timeout
        while True:
            if predicate(*arguments):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    # -- faults ------------------------------------------------------------------------------

    def set_faults(
        self,
        kind: str = "any",
        rate: float = 0.3,
        faults: Iterable[str] = ("429", "500"),
        seed: int | None = 1,
    ) -> None:
        """Give each request of ``kind`` a ``rate`` chance of one of ``faults`` (seeded)."""
        self._faults.set(kind, rate, faults, seed)

    def queue_faults(self, kind: str, faults: Iterable[str]) -> None:
        """The next len(faults) requests of ``kind`` get these faults, in order."""
        self._faults.queue(kind, faults)

    def clear_faults(self, kind: str | None = None) -> None:
        self._faults.clear(kind)

    def refuse_summaries_containing(self, *markers: str) -> None:
        """Every summarize request whose text holds one of ``markers`` is answered 400 (the
        ``content_filter`` fault), as a provider's content filter refuses a message, for as long
        as the markers stay (``clear_faults()`` drops them)."""
        self._faults.refuse(markers)

    def too_large_summaries_containing(
        self, *markers: str, fault: str = "context_length_exceeded"
    ) -> None:
        """Every summarize request whose new turns hold one of ``markers`` is over the model's
        window: answered with ``fault``, OpenAI's 400 ``context_length_exceeded`` or llama.cpp's
        ``context_exceeded`` (400, type ``exceed_context_size_error``), for as long as the
        markers stay (``clear_faults()`` drops them)."""
        self._faults.too_large(markers, fault)

    # -- answering ---------------------------------------------------------------------------

    def _serve_model_request(self, handler: Handler, path: str, body: dict[str, Any]) -> None:
        kind = classify(body)
        headers = {name.lower(): value for name, value in handler.headers.items()}
        if not handler._authorized():
            self._recorder.record(kind, path, body, headers, "unauthorized")
            handler._send_unauthorized()
            return
        fault = self._faults.draw(kind, body)
        record = self._recorder.record(kind, path, body, headers, fault)
        self._recorder.enter()
        try:
            self._answer(handler, path, body, record, fault)
        finally:
            self._recorder.leave()

    def _answer(
        self,
        handler: Handler,
        path: str,
        body: dict[str, Any],
        record: RecordedRequest,
        fault: str | None,
    ) -> None:
        delay = self.summarize_latency if record.kind == "summarize" else self.latency
        if fault == "timeout":
            delay += self.timeout_sleep
        if self._stopping.wait(delay):
            handler._hang_up()
            return
        if fault in HTTP_FAULTS:
            self._send_http_fault(handler, fault)
            return
        refused = sorted(key for key in self.refused_params if key in body)
        if refused:  # as OpenAI answers a parameter it does not know
            message = f"Unrecognized request argument supplied: {', '.join(refused)}"
            handler._send_error(400, "invalid_request_error", message, None)
            return
        if refuses_both_limits(body, self.limit_mode):
            handler._send_error(400, "invalid_request_error", BOTH_LIMITS_MESSAGE, None)
            return
        if self._over_window(handler, body, record, fault == "context_exceeded"):
            return
        reply = apply_answer_fault(self._reply(body, record), fault)
        reply = apply_limit_mode(reply, body, self.limit_mode, self.runaway_tokens)
        model = str(body.get("model") or self.models[0])
        if path == "/responses":
            self._send_response(handler, body, model, reply, record, fault)
        elif body.get("stream"):
            self._stream_chat(handler, body, model, reply, record, fault)
        else:
            completion = chat_completion_body(
                f"chatcmpl-fake-{record.number}", body, model, reply, self.cache.cached_tokens(body)
            )
            if fault == "stream_cut":
                handler._send_cut_json(completion)
            else:
                handler._send_json(200, completion)

    def _over_window(
        self, handler: Handler, body: dict[str, Any], record: RecordedRequest, forced: bool
    ) -> bool:
        """Refuse a chat prompt that does not fit ``context_window`` as llama.cpp's server does
        (its check: prompt tokens >= n_ctx); ``forced``: refuse it whatever its size."""
        counted = self.prompt_counter is not None and self.context_window is not None
        if not forced and not (counted and record.kind == "chat"):
            return False
        counter = self.prompt_counter or approx_tokens
        tokens = chatml_prompt_tokens(body, counter)
        window = self.context_window or tokens
        if counted:
            self.prompt_sizes.append(tokens)
        if tokens < window and not forced:
            return False
        error = {
            "code": 400,
            "message": LLAMA_CPP_CONTEXT_ERROR,
            "type": "exceed_context_size_error",
            "n_prompt_tokens": tokens,
            "n_ctx": window,
        }
        if body.get("stream"):
            handler._start_sse()
            handler._send_sse(json.dumps({"error": error}))
            handler.wfile.write(b"0\r\n\r\n")
        else:
            handler._send_json(400, {"error": error})
        return True

    def _reply(self, body: dict[str, Any], record: RecordedRequest) -> Reply:
        if record.kind == "summarize":
            if self.summary_fn is not None:
                return Reply(text=self.summary_fn(body))
            return Reply(text=summary_text(body, self.summary_cap_words, self.summary_habits))
        tool = requested_tool(body)
        if tool is not None:
            return Reply(
                text=None,
                finish_reason="tool_calls",
                tool_call=(self._recorder.next_tool_call_id(), tool),
            )
        if self.reply_fn is not None:
            return Reply(text=self.reply_fn(body))
        return Reply(text=chat_reply_text(record.number, body, self.reply_words))

    def _send_http_fault(self, handler: Handler, fault: str) -> None:
        status, error_type, code, message = HTTP_FAULTS[fault]
        headers = {}
        if status == 429:
            # retry-after-ms wins in the SDK and keeps retry tests fast; retry-after: 0 alone
            # would make it fall back to its 0.5 s+ exponential backoff.
            headers = {"retry-after": "0", "retry-after-ms": "10"}
        handler._send_error(status, error_type, message, code, headers)

    def _send_response(
        self,
        handler: Handler,
        body: dict[str, Any],
        model: str,
        reply: Reply,
        record: RecordedRequest,
        fault: str | None,
    ) -> None:
        if body.get("stream"):
            handler._send_error(
                400, "invalid_request_error", "The fake does not stream /v1/responses.", None
            )
            return
        payload = responses_body(f"resp_fake_{record.number}", body, model, reply)
        if fault == "stream_cut":
            handler._send_cut_json(payload)
        else:
            handler._send_json(200, payload)

    def _stream_chat(
        self,
        handler: Handler,
        body: dict[str, Any],
        model: str,
        reply: Reply,
        record: RecordedRequest,
        fault: str | None,
    ) -> None:
        completion_id = f"chatcmpl-fake-{record.number}"
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def send(delta: dict[str, Any], finish_reason: str | None = None) -> None:
            chunk = chunk_body(completion_id, model, delta, finish_reason, include_usage)
            handler._send_sse(json.dumps(chunk))

        handler._start_sse()
        send({"role": "assistant", "content": "" if reply.text is not None else None})
        for index, delta in enumerate(stream_deltas(reply)):
            if fault == "stream_cut" and index == 2:
                handler._hang_up()  # no terminating chunk: the SDK's iteration raises
                return
            if self._stopping.wait(self.chunk_delay):
                handler._hang_up()
                return
            send(delta)
        if fault == "stream_cut":
            handler._hang_up()
            return
        send({}, reply.finish_reason)
        if include_usage:
            usage_chunk = chunk_body(completion_id, model, {}, None, True)
            usage_chunk["choices"] = []
            usage_chunk["usage"] = usage_body(body, reply, self.cache.cached_tokens(body))
            handler._send_sse(json.dumps(usage_chunk))
        handler._end_sse()


def _takes_no_arguments(function: Callable[..., Any]) -> bool:
    try:
        return not inspect.signature(function).parameters
    except (TypeError, ValueError):
        return True  # builtins without a signature: call them plainly
