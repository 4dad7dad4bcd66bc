"""The fold guard's own repair (docs/policies.md, "The fold guard"): the lines a draft summary
lost, put back word for word under their heading, with the draft's weaker lines evicted, last
first, to make room under the cap. Deterministic: the guard knows what it
would have asked a model to restore, so it needs no second call unless the cap forces a choice.
Plain Python (no Django)."""

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from conversations.chat_model.tokens import count_tokens
from memory_worker.summaries.retention import HEADING_LINE, LINE_MARKUP, rank, yields_to
from memory_worker.summaries.validation import chatmem_headings

# Placeholders a section holds when it has no item: gone once an item is put back under it.
NO_ITEMS = frozenset({"none", "none.", "(none)"})


@dataclass(frozen=True)
class Restore:
    heading: str | None  # the heading it stood under in the old summary
    text: str  # the line, without its markup


@dataclass(frozen=True)
class Splice:
    text: str
    restored: tuple[str, ...]  # the lines put back
    left_out: tuple[str, ...]  # the lines that did not fit under the cap
    evicted: tuple[str, ...]  # the draft's lines without a rule or value taken out for them


def splice(
    draft: str,
    restore: Sequence[Restore],
    fits: "Fits",
    user_lines: Collection[str] = (),
) -> Splice:
    """``draft`` with each of ``restore`` (most important first: ``rank``) put back while it
    fits, evicting for each as few of the draft's lines of a lower rank as make it fit: lines
    that state no rule or value first, then (for a rule or a line a person wrote) lines that
    only carry a value; from the bottom up within a rank. A line that cannot fit even then is
    left out and nothing is evicted for it."""
    lines = draft.rstrip().splitlines()
    restored: list[str] = []
    left_out: list[str] = []
    evicted: list[str] = []
    for item in sorted(restore, key=lambda item: rank(item.text, user_lines)):
        bullet = f"- {item.text}"
        placed = with_line(lines, item.heading, bullet)
        floor = yields_to(rank(item.text, user_lines))
        while not fits("\n".join(placed)):
            candidates = evictable(placed, user_lines, keep=bullet, above=floor)
            if not candidates:
                break
            at = candidates[-1][1]
            placed = placed[:at] + placed[at + 1 :]
        if fits("\n".join(placed)):
            evicted.extend(item_text(line) for line in removed(lines, placed, bullet))
            lines = placed
            restored.append(item.text)
        else:
            left_out.append(item.text)
    return Splice("\n".join(lines), tuple(restored), tuple(left_out), tuple(evicted))


class Fits:
    """Whether a summary fits its cap: below the usable share the guard judges room by, and
    within the cap as the summarizer's own model counts it (the validator's check)."""

    def __init__(self, cap_tokens: int | None, usable_tokens: int | None, model: str | None):
        self.cap_tokens = cap_tokens
        self.usable_tokens = usable_tokens
        self.model = model

    def __call__(self, text: str) -> bool:
        if self.usable_tokens is not None and count_tokens(text) > self.usable_tokens:
            return False
        return self.cap_tokens is None or count_tokens(text, self.model) <= self.cap_tokens


def with_line(lines: list[str], heading: str | None, bullet: str) -> list[str]:
    """``lines`` with ``bullet`` at the end of the section titled like ``heading`` (the same one
    of chatmem's five headings, in whatever markup), its "- None" placeholder gone; a section
    the draft lacks is added where the five headings' order puts it (at the end for another)."""
    start = section_start(lines, heading)
    if start is None:
        if heading is None:
            return [*lines, bullet]
        at = section_after(lines, heading)
        if at is None:
            return [*lines, "", f"## {heading}", bullet]
        return [*lines[:at], f"## {heading}", bullet, "", *lines[at:]]
    end = next(
        (i for i in range(start + 1, len(lines)) if HEADING_LINE.match(lines[i])), len(lines)
    )
    body = [line for line in lines[start + 1 : end] if item_text(line).lower() not in NO_ITEMS]
    while body and not body[-1].strip():
        body.pop()
    gap = [""] if end < len(lines) else []
    return [*lines[: start + 1], *body, bullet, *gap, *lines[end:]]


def section_start(lines: Sequence[str], heading: str | None) -> int | None:
    if heading is None:
        return None
    wanted = chatmem_headings(f"## {heading}")
    for index, line in enumerate(lines):
        title = HEADING_LINE.match(line)
        if not title:
            continue
        if title.group("title") == heading or (wanted and chatmem_headings(line) == wanted):
            return index
    return None


def section_after(lines: Sequence[str], heading: str) -> int | None:
    """Where a missing section titled ``heading`` goes: before the first of chatmem's headings
    that comes after it."""
    wanted = chatmem_headings(f"## {heading}")
    if not wanted:
        return None
    for index, line in enumerate(lines):
        found = chatmem_headings(line) if HEADING_LINE.match(line) else set()
        if found and min(found) > min(wanted):
            return index
    return None


def evictable(
    lines: Sequence[str], user_lines: Collection[str], keep: str, above: int
) -> list[tuple[int, int]]:
    """(rank, index) of the items ranked below ``above`` (a higher number), the next to evict
    last: the lowest rank, and within it the bottom-most."""
    found = []
    for index, line in enumerate(lines):
        if line == keep or HEADING_LINE.match(line) or not line.strip():
            continue
        text = item_text(line)
        if text.lower() in NO_ITEMS:
            continue
        worth = rank(text, user_lines)
        if worth > above:
            found.append((worth, index))
    return sorted(found)


def removed(before: Sequence[str], after: Sequence[str], added: str) -> list[str]:
    remaining = list(after)
    if added in remaining:
        remaining.remove(added)
    gone = []
    for line in before:
        if line in remaining:
            remaining.remove(line)
        elif line.strip() and item_text(line).lower() not in NO_ITEMS:
            gone.append(line)
    return gone


def item_text(line: str) -> str:
    return LINE_MARKUP.sub("", line).strip()
