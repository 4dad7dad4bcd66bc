"""Text as PostgreSQL can store it. Client input with a NUL or an unpaired surrogate is refused
with a 400 (conversations/api/parsers.py); a model's output cannot be refused that way, so those
characters are replaced with U+FFFD instead: a stray NUL from a local model must not turn a
good reply into a 500 (``text`` columns and jsonb strings refuse NUL, and UTF-8 has no
encoding for a lone surrogate, so the reply would also break the response that carries it)."""

import re

REPLACEMENT = "\ufffd"
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable(text: str) -> str:
    # Python's JSON decoder joins a valid surrogate pair into one code point, so any code
    # point left in D800-DFFF is unpaired.
    if "\x00" not in text and text.isascii():
        return text
    return _UNSTORABLE.sub(REPLACEMENT, text)
