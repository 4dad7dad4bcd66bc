"""The admin's memory timeline: a chat's turns and folds as one SVG drawn on the server (no script,
nothing from a CDN). Top: each turn's history (the summary, pins and unfolded messages, as the
token bound counts them) and the prompt tokens the model reported, the summary's size after
each fold, and the token bounds with the background thresholds below them; bottom: the unfolded
messages each turn's context held against the message bound. Each fold is a vertical mark at
the first turn it served, coloured by kind, its range and summary in a tooltip (an SVG
<title>); a triangle marks each turn that waited for the fold in flight. The x-axis has a slot
after the last turn, for the folds no turn has used yet.

A long chat is drawn sampled: at most MAX_POINTS points per line, each the largest value of the
turns it stands for (so a peak that neared a bound still shows), and the latest MAX_FOLD_MARKS
folds and MAX_WAITED_MARKS waited turns (all counted in the legend): the SVG's size is bounded
whatever the chat's length."""

from collections.abc import Callable, Sequence
from html import escape

from django.utils.safestring import SafeString, mark_safe

from conversations.services.memory_timeline import KINDS, Fold, Timeline, Turn

MAX_POINTS = 1000
MAX_FOLD_MARKS = 700
MAX_WAITED_MARKS = 200
WIDTH, LEFT, RIGHT = 960, 64, 16
TOKENS_TOP, TOKENS_HEIGHT = 28, 220
MESSAGES_TOP, MESSAGES_HEIGHT = 290, 110
HEIGHT = 460
COLOURS = {
    "background": "#2b7bb9",
    "synchronous": "#e377c2",
    "manual": "#9467bd",
    "fallback": "#ff7f0e",
    "edit": "#2ca02c",
}
PROMPT, HISTORY, SUMMARY = "#999", "#333", "#17becf"
BOUND, THRESHOLD = "#d62728", "#e7a33b"
WAITED = "#8c564b"
# Shared by every mark of a kind: said once, not on each of a long chat's marks.
STYLE = (
    "<style>.chatmem-timeline .fold{stroke-opacity:.55;stroke-width:1}"
    + "".join(f".chatmem-timeline .fold-{k}{{stroke:{c}}}" for k, c in COLOURS.items())
    + f".chatmem-timeline .summary-size{{fill:{SUMMARY}}}"
    + f".chatmem-timeline .waited{{fill:{WAITED}}}</style>"
)


def timeline_svg(timeline: Timeline) -> SafeString:
    turns, folds, limits = timeline.turns, timeline.folds, timeline.limits
    if not turns:
        return mark_safe("<p>(no replies yet: the timeline starts with the first turn)</p>")
    x = _x_scale(len(turns))
    parts: list[str] = []
    # Tokens: the history and the prompt, the summary, and the token lines within reach of the
    # data (a 128k window's prompt bound over a short chat is named, not drawn).
    token_lines = [
        ("prompt bound", "bound", limits.prompt_bound),
        ("prompt threshold", "threshold", limits.prompt_trigger),
        ("history token bound", "bound", limits.token_bound),
        ("history token threshold", "threshold", limits.token_trigger),
    ]
    values = [max(t.prompt_tokens, t.history_tokens) for t in turns]
    peak = max([*values, *(f.summary_tokens for f in folds), 1])
    drawn = [(n, c, v) for n, c, v in token_lines if v is not None and v <= peak * 3]
    top = max([peak, *(v for _, _, v in drawn)]) * 1.08
    y = _y_scale(top, TOKENS_TOP, TOKENS_HEIGHT)
    parts.append(_axis("tokens", TOKENS_TOP, TOKENS_HEIGHT, top))
    for name, css, value in drawn:
        parts.append(_level(name, css, value, y))
    above = [(n, v) for n, c, v in token_lines if v is not None and v > peak * 3]
    if above:
        text = "; ".join(f"{n} {v:,}" for n, v in above) + " (above the chart)"
        parts.append(_text(LEFT + 4, TOKENS_TOP - 8, text, "note"))
    parts.append(_polyline("prompt", PROMPT, _points(turns, lambda t: t.prompt_tokens, x, y)))
    parts.append(_polyline("history", HISTORY, _points(turns, lambda t: t.history_tokens, x, y)))
    parts.append(_summary_steps(folds, len(turns), x, y))
    # Unfolded messages against the message bound.
    message_peak = max([t.unfolded for t in turns] + [limits.message_bound or 0, 1])
    y_messages = _y_scale(message_peak * 1.08, MESSAGES_TOP, MESSAGES_HEIGHT)
    parts.append(_axis("unfolded messages", MESSAGES_TOP, MESSAGES_HEIGHT, message_peak * 1.08))
    for label, kind, level in (
        ("message bound", "bound", limits.message_bound),
        ("message threshold", "threshold", limits.message_trigger),
    ):
        if level is not None:
            parts.append(_level(label, kind, level, y_messages))
    unfolded = _points(turns, lambda t: t.unfolded, x, y_messages)
    parts.append(_polyline("unfolded", HISTORY, unfolded))
    parts.append(_fold_marks(folds, x))
    parts.append(_waited_marks(turns, x))
    parts.append(_legend(folds, len(turns), sum(t.waited for t in turns)))
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chatmem-timeline" role="img" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        f'data-turns="{len(turns)}" data-folds="{len(folds)}">'
        f"<title>Memory timeline: {len(turns):,} turns, {len(folds):,} folds</title>{STYLE}"
        + "".join(parts)
        + "</svg>"
    )
    return mark_safe(svg)  # every text in it went through escape()


def _x_scale(count: int) -> Callable[[float], float]:
    """Turns at 0..count-1, and a slot at count (the right edge) for what came after the last."""
    span = WIDTH - LEFT - RIGHT
    return lambda index: LEFT + span * (min(index, count) / max(count, 1))


def _y_scale(top: float, offset: int, height: int) -> Callable[[float], float]:
    return lambda value: offset + height - height * (value / top if top else 0)


def _points(
    turns: Sequence[Turn],
    value: Callable[[Turn], int],
    x: Callable[[float], float],
    y: Callable[[float], float],
) -> list[tuple[float, float]]:
    """One point per turn, or per bucket of turns (its largest value) past MAX_POINTS."""
    step = max(1, -(-len(turns) // MAX_POINTS))
    return [
        (x(start), y(max(value(t) for t in turns[start : start + step])))
        for start in range(0, len(turns), step)
    ]


def _polyline(name: str, colour: str, points: list[tuple[float, float]]) -> str:
    coordinates = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
    return (
        f'<polyline class="series {name}" data-series="{name}" fill="none" stroke="{colour}" '
        f'stroke-width="1.2" points="{coordinates}"><title>{name}</title></polyline>'
    )


def _summary_steps(
    folds: Sequence[Fold],
    turns: int,
    x: Callable[[float], float],
    y: Callable[[float], float],
) -> str:
    """The summary's size, a step after each fold; a dot per fold with its size (the last
    MAX_FOLD_MARKS folds when there are more)."""
    if not folds:
        return ""
    points: list[tuple[float, float]] = []
    size = 0
    for fold in folds:
        points += [(x(fold.turn_index), y(size)), (x(fold.turn_index), y(fold.summary_tokens))]
        size = fold.summary_tokens
    points.append((x(turns), y(size)))
    if len(points) > 2 * MAX_POINTS:
        step = -(-len(points) // (2 * MAX_POINTS))
        points = [*points[::step], points[-1]]
    dots = "".join(
        f'<circle class="summary-size" data-fold-id="{f.id}" data-tokens="{f.summary_tokens}" '
        f'cx="{x(f.turn_index):.1f}" cy="{y(f.summary_tokens):.1f}" r="2"/>'
        for f in folds[-MAX_FOLD_MARKS:]
    )
    return _polyline("summary", SUMMARY, points) + dots


def _fold_marks(folds: Sequence[Fold], x: Callable[[float], float]) -> str:
    marks = []
    for fold in folds[-MAX_FOLD_MARKS:]:
        px = x(fold.turn_index)
        what = (
            f"fold {fold.id}: {fold.kind} ({fold.trigger}), messages {fold.from_seq}..{fold.to_seq}"
            if fold.kind != "edit"
            else f"edit {fold.id}: the summary written by a person"
        )
        marks.append(
            f'<line class="fold fold-{fold.kind}" data-kind="{fold.kind}" data-fold-id="{fold.id}" '
            f'x1="{px:.1f}" x2="{px:.1f}" y1="{TOKENS_TOP}" y2="{MESSAGES_TOP + MESSAGES_HEIGHT}">'
            f"<title>{escape(what)}; summary {fold.summary_tokens:,} tokens</title></line>"
        )
    return "".join(marks)


def _waited_marks(turns: Sequence[Turn], x: Callable[[float], float]) -> str:
    """A triangle under each turn that waited for the fold in flight (the latest of them)."""
    waited = [(index, turn) for index, turn in enumerate(turns) if turn.waited]
    bottom = TOKENS_TOP + TOKENS_HEIGHT
    return "".join(
        f'<path class="waited" data-seq="{turn.seq}" d="M{x(index):.1f} {bottom - 7} l-4 7 h8 z">'
        f"<title>turn {turn.seq}: waited for the fold in flight</title></path>"
        for index, turn in waited[-MAX_WAITED_MARKS:]
    )


def _level(name: str, css: str, value: int, y: Callable[[float], float]) -> str:
    colour = BOUND if css == "bound" else THRESHOLD
    dash = "" if css == "bound" else ' stroke-dasharray="5 4"'
    py = y(value)
    return (
        f'<line class="{css}" data-line="{escape(name)}" data-value="{value}" x1="{LEFT}" '
        f'x2="{WIDTH - RIGHT}" y1="{py:.1f}" y2="{py:.1f}" stroke="{colour}"{dash}>'
        f"<title>{escape(name)}: {value:,}</title></line>"
        # A bound's label above its line, a threshold's below: the two are often close.
        + _text(
            WIDTH - RIGHT - 4,
            py - 3 if css == "bound" else py + 12,
            f"{name} {value:,}",
            "level",
            anchor="end",
        )
    )


def _axis(label: str, top: int, height: int, maximum: float) -> str:
    bottom = top + height
    return (
        f'<line class="axis" x1="{LEFT}" x2="{LEFT}" y1="{top}" y2="{bottom}" stroke="#999"/>'
        f'<line class="axis" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{bottom}" y2="{bottom}" '
        f'stroke="#999"/>'
        + _text(LEFT - 6, top + 10, f"{maximum:,.0f}", "tick", anchor="end")
        + _text(LEFT - 6, bottom, "0", "tick", anchor="end")
        + _text(LEFT + 4, top + 10, label, "label")
    )


def _legend(folds: Sequence[Fold], turns: int, waited: int) -> str:
    counts = {kind: sum(f.kind == kind for f in folds) for kind in KINDS}
    items = [
        ("history tokens / unfolded messages", HISTORY, "series"),
        ("prompt tokens (as the model reported)", PROMPT, "series"),
        ("summary tokens", SUMMARY, "series"),
        ("bound", BOUND, "series"),
        ("threshold", THRESHOLD, "series"),
        (f"turns that waited for a fold: {waited}", WAITED, "waited"),
    ]
    items += [(f"{kind} folds: {counts[kind]}", COLOURS[kind], kind) for kind in KINDS]
    drawn = min(len(folds), MAX_FOLD_MARKS)
    shown = "" if drawn == len(folds) else f" ({drawn:,} latest drawn)"
    out = [f'<g class="legend" data-turns="{turns}">']
    px, row = LEFT, 0
    for text, colour, kind in items:
        width = 14 + 6 * len(text) + 16
        if px + width > WIDTH - RIGHT:
            px, row = LEFT, row + 1
        top = MESSAGES_TOP + MESSAGES_HEIGHT + 10 + 16 * row
        out.append(
            f'<g class="legend-item" data-kind="{kind}"><rect x="{px}" y="{top}" '
            f'width="10" height="10" fill="{colour}"/>'
            + _text(px + 14, top + 9, text, "legend-text")
            + "</g>"
        )
        px += width
    out.append(_text(LEFT, HEIGHT - 8, f"turns 1..{turns:,}{shown}", "legend-text"))
    out.append("</g>")
    return "".join(out)


def _text(x: float, y: float, text: str, css: str, anchor: str = "start") -> str:
    return (
        f'<text class="{css}" x="{x:.1f}" y="{y:.1f}" font-size="11" text-anchor="{anchor}" '
        f'fill="#333">{escape(text)}</text>'
    )
