"""The API's JSON parser: DRF's, refusing with a 400 what would otherwise fail later as a 500.

- Nesting deeper than MAX_JSON_DEPTH. Python's decoder raises RecursionError (not ValueError,
  which is all DRF's parser catches) at about a thousand levels, a 2 KB body; well below that,
  PostgreSQL's jsonb and the renderer each have their own limit, reached only after the model
  was called.
- A string, key or value, holding U+0000 or an unpaired surrogate (``"\\ud800"``, valid JSON).
  PostgreSQL stores neither in text or jsonb, and no UTF-8 encoder writes a surrogate: a turn
  carrying one in metadata would fail when it stores its messages, after the model call. DRF's
  CharField refuses both, but only in the fields that are CharFields; this covers every field,
  the agent context's free-form step results and the OpenAI-compatible endpoint included.
"""

from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

MAX_JSON_DEPTH = 64


class StrictJSONParser(JSONParser):
    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError as error:
            raise ParseError(
                f"JSON parse error - nested deeper than {MAX_JSON_DEPTH} levels."
            ) from error
        problem = first_problem(data)
        if problem is not None:
            raise ParseError(f"JSON parse error - {problem}")
        return data


def first_problem(data: Any) -> str | None:
    """What makes a parsed document unusable, naming where (``messages[2].content``), or None.
    Iterative: a recursive walk could itself exceed the interpreter's recursion limit."""
    pending: list[tuple[Any, str, int]] = [(data, "", 0)]
    while pending:
        value, path, depth = pending.pop()
        if isinstance(value, str):
            problem = unstorable(value)
            if problem:
                return f"the string at {path or 'the top level'} contains {problem}."
        elif isinstance(value, dict | list):
            if depth >= MAX_JSON_DEPTH:
                return f"nested deeper than {MAX_JSON_DEPTH} levels at {path or 'the top level'}."
            if isinstance(value, list):
                pending.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
                continue
            for key, item in value.items():
                where = f"{path}.{key}" if path else key
                problem = unstorable(key)
                if problem:
                    return f"the key {where!a} contains {problem}."
                pending.append((item, where, depth + 1))
    return None


def unstorable(text: str) -> str | None:
    # At C speed (a /v1 request may resend a whole history): ``in`` is a memchr, an ASCII
    # string (a flag CPython keeps on every string) holds no surrogate, and the UTF-8 encoder
    # stops at the first one (a regex would scan the whole text in Python's regex engine).
    if "\x00" in text:
        return "a NUL character (U+0000), which cannot be stored"
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"an unpaired surrogate (U+{ord(text[error.start]):04X}), which is not text"
    return None
