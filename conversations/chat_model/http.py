"""The turn's one non-streamed Chat Completions request, sent over a plain keep-alive connection
of the calling thread instead of through the ``openai`` SDK's HTTP stack. Plain Python, no Django.

Why: the SDK's connection pool is shared by a process's threads and locked and scanned on every
request and answer; with hundreds of threads waiting on a slow model that is a large share of a
web process's CPU (``python -m bench.model_call``, docs/benchmarks.md).

What stays the SDK's: the endpoint, key, organization and project it resolved (from our settings
or its own environment variables), and everything else the model is asked (streamed turns, the
summarizers, the Responses API: conversations.chat_model.transport). What this client does as the
SDK's HTTP stack does: the same path, JSON body and headers that matter (authorization, content
type, organization, project); the same TLS context (``httpx2.create_ssl_context``: the
SSL_CERT_FILE/SSL_CERT_DIR variables, then the system's certificates); a keep-alive connection is
not reused after 5 s idle or once the server has closed it (httpcore's keepalive_expiry and
readability check); no retries (the turn's SDK client has none either). An HTTP(S) proxy set in
the environment is something only the SDK honours, so ``direct_client`` declines and the SDK
sends the request.
"""

import http.client
import json
import select
import ssl
import threading
import time
import urllib.request
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import openai

from conversations.chat_model.transport import redact

KEEPALIVE_EXPIRY_SECONDS = 5.0  # the SDK's (openai DEFAULT_CONNECTION_LIMITS)
MAX_LOGGED_BODY = 500


class DirectTimeout(Exception):
    pass


class DirectConnectionError(Exception):
    pass


class DirectStatusError(Exception):
    """``str()`` has the status and the start of the body, for the log (not for the client)."""

    def __init__(self, status: int, data: bytes) -> None:
        # Providers echo (masked) keys in auth errors: none reaches the log either. Redacted
        # whole, then cut: a key cut at the edge first would slip past the patterns.
        detail = redact(data.decode("utf-8", errors="replace"))[:MAX_LOGGED_BODY]
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.code = error_code(data)
        self.message = error_field(data, "message")
        self.body = data.decode("utf-8", errors="replace")  # whole, to read (never logged)


class DirectInvalidResponse(Exception):
    pass


class _ThreadConnection(threading.local):
    connection: http.client.HTTPConnection | None = None
    idle_since: float = 0.0


class DirectChatCompletions:
    def __init__(
        self,
        base_url: str,
        headers: Mapping[str, str],
        timeout: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) endpoint: {base_url}")
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.path = parts.path.rstrip("/") + "/chat/completions"
        self.headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            **headers,
        }
        self.timeout = timeout
        self.ssl_context = (ssl_context or default_ssl_context()) if self.https else None
        self._local = _ThreadConnection()

    def create(self, body: Mapping[str, Any]) -> Any:
        """POST the body; the decoded JSON of a 2xx answer. Raises the Direct* errors."""
        payload = json.dumps(body).encode()
        connection = self._connection()
        try:
            connection.request("POST", self.path, body=payload, headers=self.headers)
            response = connection.getresponse()
            data = response.read()
        except TimeoutError as error:
            self._discard()
            raise DirectTimeout(str(error)) from error
        except (OSError, http.client.HTTPException) as error:
            self._discard()
            raise DirectConnectionError(str(error)) from error
        if response.will_close:
            self._discard()
        else:
            self._local.idle_since = time.monotonic()
        if response.status >= 400:
            raise DirectStatusError(response.status, data)
        try:
            return json.loads(data)
        except ValueError as error:
            raise DirectInvalidResponse("the answer is not JSON") from error

    def _connection(self) -> http.client.HTTPConnection:
        local = self._local
        connection = local.connection
        if connection is not None and (
            time.monotonic() - local.idle_since > KEEPALIVE_EXPIRY_SECONDS
            or closed_by_peer(connection)
        ):
            self._discard()
            connection = None
        if connection is None:
            connection = local.connection = self._open()
        return connection

    def _open(self) -> http.client.HTTPConnection:
        if self.https:
            return http.client.HTTPSConnection(
                self.host, self.port, timeout=self.timeout, context=self.ssl_context
            )
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def _discard(self) -> None:
        if self._local.connection is not None:
            self._local.connection.close()
            self._local.connection = None


def closed_by_peer(connection: http.client.HTTPConnection) -> bool:
    """An idle keep-alive connection that has something to read has been closed by the server
    (or sent something unasked): not reusable."""
    sock = connection.sock
    if sock is None:
        return False  # not connected yet: request() connects
    # poll, not select: select fails on descriptors above 1023, which a process with hundreds
    # of threads, each with its client, database and model connections, can reach.
    if not hasattr(select, "poll"):  # Windows
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def error_code(data: bytes) -> object:
    """The provider's error code, where the SDK finds it: ``error.code`` (or a top-level
    ``code``) of a JSON error body."""
    return error_field(data, "code")


def error_field(data: bytes, name: str) -> object:
    try:
        body = json.loads(data)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    detail = body.get("error", body)
    return detail.get(name) if isinstance(detail, dict) else None


def default_ssl_context() -> ssl.SSLContext:
    try:
        import httpx2

        return httpx2.create_ssl_context()
    except ImportError:  # an SDK release on httpx instead
        import httpx

        return httpx.create_ssl_context()


def direct_client(client: openai.OpenAI, timeout: float) -> DirectChatCompletions | None:
    """A direct client for the SDK client's endpoint, or None when the SDK should send the
    request itself (a proxy applies to the endpoint)."""
    base_url = str(client.base_url)
    parts = urlsplit(base_url)
    if proxy_applies(parts.scheme, parts.hostname or ""):
        return None
    headers = {"Authorization": f"Bearer {client.api_key}"}
    if client.organization:
        headers["OpenAI-Organization"] = client.organization
    if client.project:
        headers["OpenAI-Project"] = client.project
    return DirectChatCompletions(base_url, headers, timeout)


def proxy_applies(scheme: str, host: str) -> bool:
    proxies = urllib.request.getproxies_environment()
    if not (proxies.get(scheme) or proxies.get("all")):
        return False
    return not urllib.request.proxy_bypass(host)
