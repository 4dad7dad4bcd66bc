"""How the admin's chat page shows memory, once and plainly: the summary with its tokens against
the cap, each history row folded or verbatim, the next fold's outlook in one line (from
services.fold_outlook, the engine's own decision), and one timestamp format."""

import math
from collections.abc import Sequence
from datetime import datetime

from django.utils import formats, timezone
from django.utils.html import format_html, format_html_join, linebreaks
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import Truncator

from conversations.services.context import SUMMARY_HEADER
from conversations.services.fold_outlook import FoldOutlook
from conversations.services.prompt_cache import PromptCacheTotals
from memory_worker.engine.policy import Measure

FOLDED, VERBATIM = "folded", "verbatim"

# Each engine measure in words, "{t}" its threshold and "{v}" where the chat stands.
PHRASES = {
    "prompt tokens": "the whole prompt passes {t} tokens (now {v})",
    "history tokens": "the summary and unfolded messages pass {t} tokens (now {v})",
    "unfolded messages": "more than {t} messages are unfolded (now {v})",
    "backlog messages": "{t} messages beyond the verbatim tail can be folded (now {v})",
    "user turns": "{t} user turns have passed since the last fold (now {v})",
    "seconds since the last fold": "{t} s have passed since the last fold (now {v} s)",
}


def when(moment: datetime | None) -> str:
    """Every time on the admin's pages in the one format its lists use (DATETIME_FORMAT,
    chatmem_project/formats), in the server's TIME_ZONE."""
    if moment is None:
        return "-"
    return formats.localize(timezone.localtime(moment))


def memory_mark(seq: int, watermark: int) -> str:
    """A history row's place in memory: folded into the summary (seq <= W) or sent verbatim."""
    return FOLDED if seq <= watermark else VERBATIM


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> SafeString:
    head = format_html_join("", "<th>{}</th>", ((cell,) for cell in header))
    body = format_html_join(
        "",
        "<tr>{}</tr>",
        ((format_html_join("", "<td>{}</td>", ((cell,) for cell in row)),) for row in rows),
    )
    return format_html('<table class="chatmem-table"><tr>{}</tr>{}</table>', head, body)


def summary_block(summary: str, outlook: FoldOutlook) -> SafeString:
    counted = format_html(
        '<p class="chatmem-summary-tokens"><strong>{} / {} tokens</strong> (the summary against '
        "its cap); folded: messages 1..{}</p>",
        f"{outlook.summary_tokens:,}",
        f"{outlook.summary_cap:,}",
        outlook.watermark,
    )
    if not summary:
        return format_html("{}<p>(no summary yet)</p>", counted)
    # linebreaks escapes the text itself (autoescape=True): safe to mark as such.
    rendered = mark_safe(linebreaks(summary, autoescape=True))
    return format_html('{}<div class="chatmem-summary">{}</div>', counted, rendered)


def context_rows(messages: Sequence[dict[str, object]]) -> list[list[object]]:
    """The next context's rows, the summary's message named rather than repeated (it is shown
    once, under Memory)."""
    rows: list[list[object]] = []
    for message in messages:
        content = str(message.get("content") or "")
        if message["role"] == "system" and content.startswith(SUMMARY_HEADER):
            shown = format_html("<em>{}</em>", "(the summary, as shown under Memory)")
        else:
            shown = format_html("<pre>{}</pre>", content)
        rows.append([message["role"], shown])
    return rows


def _number(value: float) -> str:
    return f"{value:,.0f}" if math.isfinite(value) else "no fold yet"


def phrase(measure: Measure) -> str:
    template = PHRASES.get(measure.quantity, measure.quantity + " at {v} against {t}")
    return template.format(t=_number(measure.threshold), v=_number(measure.value))


def outlook_line(outlook: FoldOutlook) -> str:
    """One line: degraded, backing off, due now (and why), or when the next fold is due."""
    if outlook.degraded:
        return (
            f"degraded: the last {outlook.consecutive_failures} folds failed ({outlook.last_error}"
            "); turns still answer, the summary waits for a fold that succeeds (Consolidate now "
            "retries at once)."
        )
    if outlook.backing_off_until is not None:
        return (
            f"paused: the last fold failed ({outlook.last_error}); the next attempt is at "
            f"{when(outlook.backing_off_until)}."
        )
    if outlook.due is not None:
        why = phrase(outlook.due_measure) + "; " if outlook.due_measure is not None else ""
        return (
            f"due now: {why}trigger {outlook.due.trigger.value}; the fold takes messages "
            f"{outlook.due.from_seq}..{outlook.due.to_seq}."
        )
    if outlook.held:
        return (
            "not due: a trigger is reached but every unfolded message is in the verbatim tail; "
            "the next turn makes room to fold."
        )
    if outlook.nearest is None:
        return "next fold: when there is something to fold."
    return f"next fold: when {phrase(outlook.nearest)}; trigger {outlook.nearest.trigger.value}."


def prompt_cache_line(totals: PromptCacheTotals) -> str:
    if totals.cached_share is None:
        return "no model reply has reported its usage yet."
    return (
        f"{totals.cached_tokens:,} of {totals.prompt_tokens:,} prompt tokens "
        f"({totals.cached_share:.0%}) served from the provider's prompt cache, over "
        f"{totals.replies:,} replies (each reply's cached tokens are in its metadata)."
    )


def content_preview(content: str, length: int = 80) -> str:
    return Truncator(content.replace("\n", " ")).chars(length)


def degraded_badge(degraded: bool) -> str:
    """A warning when folds keep failing; nothing otherwise (a red "no" read as an alarm)."""
    if not degraded:
        return ""
    return mark_safe('<strong class="chatmem-warning">⚠ degraded: folds keep failing</strong>')
