"""Prometheus metrics at ``/metrics``.

Three sources, so the memory code stays free of metric calls:

- request timing (``RequestMetricsMiddleware``): turn latency, per endpoint and status;
- the model client (``TimedChatModel``, wrapped around the configured model): model latency and
  time to first token;
- the structured log events the services already write (``MetricsLogHandler``): folds by trigger
  and outcome, fold duration, summarizer tokens, dropped details, fold guard verdicts,
  synchronous folds, lock contention, reruns, enqueue failures and skips, throttle skips;
- and, read from the database at scrape time (conversations.metrics_endpoint): unfolded
  messages, chats waiting for a retry, degraded chats.

This module loads with the LOGGING setting (MetricsLogHandler), before the apps: it imports no
model.

Several processes (gunicorn workers, Celery prefork children): set ``PROMETHEUS_MULTIPROC_DIR``
to a directory of each server's own (one for gunicorn, one for each Celery worker: each clears
its own at start), and its processes' samples are summed at scrape time (prometheus_client's
multiprocess mode). Celery workers expose theirs on ``WORKER_METRICS_PORT`` (see
chatmem_project/celery.py)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from django.http import HttpRequest, HttpResponse

# Multiprocess mode writes each process's samples under this directory: it must exist before
# prometheus_client creates the first metric.
if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    multiprocess,
)
from prometheus_client.registry import REGISTRY

from conversations.chat_model.contract import (
    ChatCompletion,
    ChatModel,
    CompletionStream,
    ModelMessages,
)

log = logging.getLogger("chatmem.metrics")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TURN_ENDPOINTS = {"chat-turns": "turns", "openai-chat-completions": "chat_completions"}

TURN_SECONDS = Histogram(
    "chatmem_turn_seconds",
    "Turn latency as the client sees it (until the response starts, for streams).",
    ["endpoint", "status"],
    buckets=LATENCY_BUCKETS,
)
MODEL_SECONDS = Histogram(
    "chatmem_model_seconds",
    "Model call latency (the whole reply).",
    ["mode"],
    buckets=LATENCY_BUCKETS,
)
MODEL_FIRST_TOKEN_SECONDS = Histogram(
    "chatmem_model_first_token_seconds",
    "Streamed model calls: time to the first content delta.",
    buckets=LATENCY_BUCKETS,
)
FOLDS = Counter(
    "chatmem_folds_total", "Fold attempts by trigger and outcome.", ["trigger", "outcome"]
)
FOLD_SECONDS = Histogram(
    "chatmem_fold_seconds", "Fold duration (summarizer call and commit).", buckets=LATENCY_BUCKETS
)
CONSOLIDATION_LAG_SECONDS = Histogram(
    "chatmem_consolidation_lag_seconds",
    "From the turn that found a fold due to the fold's commit (folds a turn asked for).",
    buckets=LATENCY_BUCKETS,
)
MODEL_INPUT_TOKENS = Counter(
    "chatmem_model_input_tokens_total",
    "Prompt tokens of the chat model's replies by model variant, as the server reported them: "
    "cached (served from its prompt cache) and uncached.",
    ["variant", "cache"],
)
SUMMARIZER_TOKENS = Counter(
    "chatmem_summarizer_tokens_total", "Tokens sent to and received from the summarizer.", ["kind"]
)
DROPPED_DETAILS = Counter(
    "chatmem_fold_dropped_details_total",
    "Exact details (numbers, codes, dates, URLs, names) of committed folds' input absent from "
    "their summary: the loss report.",
)
FOLD_GUARD = Counter(
    "chatmem_fold_guard_total",
    "Fold guard verdicts on a summary that dropped a rule or exact value: spliced (put back "
    "with no call), repair (one more summarizer call, only when the cap forces a choice), "
    "repaired, refused.",
    ["outcome"],
)
SYNC_FOLDS = Counter(
    "chatmem_sync_folds_total", "Folds run on the request path before a model call."
)
SYNC_FOLD_WAITS = Counter(
    "chatmem_sync_fold_waits_total",
    "Turns over their bound that waited for the fold in flight instead of folding themselves.",
)
LOCK_CONTENDED = Counter(
    "chatmem_lock_contended_total", "Consolidation triggers that found the chat's lock held."
)
RERUNS = Counter("chatmem_reruns_total", "Consolidation reruns after a trigger during a run.")
ENQUEUE_FAILED = Counter(
    "chatmem_enqueue_failures_total",
    "Memory work (consolidations, agent-state updates, flush hooks) the broker did not take.",
)
ENQUEUE_SKIPPED = Counter(
    "chatmem_enqueue_skipped_total",
    "Memory work not offered to the broker while a Redis timeout held the request path's "
    "breaker open (the sweep finds the chats).",
)
# Each Celery pool process sets 1 at start; the worker's scrape sums its live processes.
WORKER_POOL_PROCESSES = Gauge(
    "chatmem_worker_pool_processes",
    "Celery pool processes alive in this worker (its scrape target; 0 on web processes); count "
    "the targets above 0 for the number of workers.",
    multiprocess_mode="livesum",
)
THROTTLE_SKIPPED = Counter(
    "chatmem_throttle_skipped_total",
    "Turns let through unthrottled because the cache failed, timed out, or timed out recently.",
)


# --- sources ---------------------------------------------------------------------------------


class RequestMetricsMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        started = time.perf_counter()
        response = self.get_response(request)
        match = request.resolver_match
        endpoint = TURN_ENDPOINTS.get(match.url_name or "") if match else None
        if endpoint:
            TURN_SECONDS.labels(endpoint, str(response.status_code)).observe(
                time.perf_counter() - started
            )
        return response


class TimedChatModel:
    """The configured model, timed."""

    def __init__(self, model: ChatModel) -> None:
        self.model = model

    def complete(self, messages: ModelMessages, model: str, tools: Any = None) -> ChatCompletion:
        with MODEL_SECONDS.labels("complete").time():
            return self.model.complete(messages, model, tools)

    def stream(self, messages: ModelMessages, model: str, tools: Any = None) -> CompletionStream:
        started = time.perf_counter()
        inner = self.model.stream(messages, model, tools)
        return CompletionStream(timed_deltas(inner, started), release=inner.close)


def timed_deltas(inner: CompletionStream, started: float) -> Any:
    first = True
    for delta in inner:
        if first:
            MODEL_FIRST_TOKEN_SECONDS.observe(time.perf_counter() - started)
            first = False
        yield delta
    MODEL_SECONDS.labels("stream").observe(time.perf_counter() - started)
    assert inner.result is not None
    return inner.result


class MetricsLogHandler(logging.Handler):
    """Counts the structured events the services log (their ``extra={"event": ...}``)."""

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "event", None)
        try:
            if event == "fold":
                self.fold(record)
            elif event == "fold_guard":
                FOLD_GUARD.labels(str(getattr(record, "outcome", "unknown"))).inc()
            elif event == "sync_fold":
                SYNC_FOLDS.inc()
            elif event == "sync_fold_wait":
                SYNC_FOLD_WAITS.inc()
            elif event == "lock_contended":
                LOCK_CONTENDED.inc()
            elif event == "enqueue_failed":
                ENQUEUE_FAILED.inc()
            elif event == "enqueue_skipped":
                ENQUEUE_SKIPPED.inc()
            elif event == "throttle_skipped":
                THROTTLE_SKIPPED.inc()
            elif event == "model_usage":
                self.model_usage(record)
        except Exception:  # metrics must never break the code that logs
            self.handleError(record)

    @staticmethod
    def model_usage(record: logging.LogRecord) -> None:
        variant = str(getattr(record, "variant", "unknown"))
        prompt, cached = getattr(record, "prompt_tokens", 0), getattr(record, "cached_tokens", 0)
        if isinstance(prompt, int) and isinstance(cached, int):
            MODEL_INPUT_TOKENS.labels(variant, "cached").inc(max(0, min(cached, prompt)))
            MODEL_INPUT_TOKENS.labels(variant, "uncached").inc(max(0, prompt - cached))

    @staticmethod
    def fold(record: logging.LogRecord) -> None:
        trigger = str(getattr(record, "trigger", "unknown"))
        FOLDS.labels(trigger, str(getattr(record, "outcome", "unknown"))).inc()
        if trigger == "rerun":
            RERUNS.inc()
        duration_ms = getattr(record, "duration_ms", None)
        if isinstance(duration_ms, int | float):
            FOLD_SECONDS.observe(duration_ms / 1000)
        succeeded = getattr(record, "outcome", "") == "succeeded"
        lag = getattr(record, "lag_ms", None)
        if isinstance(lag, int | float) and succeeded:
            CONSOLIDATION_LAG_SECONDS.observe(lag / 1000)
        dropped = getattr(record, "dropped_details", None)
        if isinstance(dropped, int) and dropped > 0 and succeeded:
            DROPPED_DETAILS.inc(dropped)
        for kind in ("input_tokens", "output_tokens"):
            tokens = getattr(record, kind, None)
            if isinstance(tokens, int) and tokens > 0:
                SUMMARIZER_TOKENS.labels(kind.removesuffix("_tokens")).inc(tokens)


# --- exposition ------------------------------------------------------------------------------


def registry() -> CollectorRegistry:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        aggregated = CollectorRegistry()
        multiprocess.MultiProcessCollector(aggregated)
        return aggregated
    return REGISTRY
