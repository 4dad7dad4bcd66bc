"""The terminal side of ``manage.py chat``: line editing and history on a terminal, what may be
stored of a typed line, and log output kept off the prompt."""

from __future__ import annotations

import logging
import re
import readline  # noqa: F401 - imported, it gives input() line editing and a history
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

# An escape sequence as terminals send them for keys (CSI "ESC [ ... final", SS3 "ESC O x"),
# OSC strings, two-character escapes, or a lone ESC.
ESCAPE_SEQUENCE = re.compile(
    r"\x1b(?:\[[0-?]*[ -/]*[@-~]|O.|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])?"
)
# C0 (but tab, and NUL, which is refused as the API refuses it), DEL and C1 controls.
CONTROL_CHARACTER = re.compile(r"[\x01-\x08\x0a-\x1f\x7f-\x9f]")


def printable(line: str) -> tuple[str, int]:
    """``line`` without escape sequences and control characters (what a key the line editor did
    not handle leaves, or what a pipe brings); and how many were removed."""
    without_escapes, escapes = ESCAPE_SEQUENCE.subn("", line)
    text, controls = CONTROL_CHARACTER.subn("", without_escapes)
    return text, escapes + controls


class LineReader:
    """Reads the user's lines: through GNU readline (arrow keys, Ctrl-A/E, history with Up) on
    a terminal, else line by line from the stream (pipes, tests)."""

    def __init__(self, stdin: TextIO) -> None:
        self.stdin = stdin
        # input() edits with readline only when both ends are the terminal.
        self.interactive = stdin is sys.stdin and stdin.isatty() and sys.stdout.isatty()

    def read(self, prompt: str) -> str | None:
        """The next line without its end, or None at end of input. On a terminal readline shows
        ``prompt`` (it redraws it while editing); elsewhere the caller has written it."""
        if self.interactive:
            try:
                return input(prompt)
            except EOFError:
                return None
        line = self.stdin.readline()
        return line.rstrip("\r\n") if line else None


@contextmanager
def logs_to_file(path: Path) -> Iterator[None]:
    """Log handlers writing to the terminal write to ``path`` instead: a fold logged by a
    background thread landed in the middle of the line being typed."""
    terminal = {sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__}
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    handlers = {
        handler
        for logger in loggers
        if isinstance(logger, logging.Logger)
        for handler in logger.handlers
        if type(handler) is logging.StreamHandler and handler.stream in terminal
    }
    previous = {handler: handler.stream for handler in handlers}
    with path.open("a", encoding="utf-8") as log_file:
        for handler in handlers:
            handler.setStream(log_file)
        try:
            yield
        finally:
            for handler, stream in previous.items():
                handler.setStream(stream)
