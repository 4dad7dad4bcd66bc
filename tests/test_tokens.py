"""Token counting (seed 002): the offline tiktoken encoding, never a download, and the
``len(text) // 4`` fallback that warns once per process. No database, no Django."""

import hashlib
import logging
import shutil
import socket
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import tiktoken

from memory_worker import bundled_encodings, tokens
from memory_worker.tokens import count_tokens, encoding_name


@pytest.fixture(autouse=True)
def fresh_caches() -> Iterator[None]:
    # Cached encodings (or a cached failure) must not leak between tests.
    tokens.clear_caches()
    yield
    tokens.clear_caches()


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sockets refuse to connect, and tiktoken forgets the encodings it already built, so the
    encoding really is rebuilt here: any download attempt would fail the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("token counting tried to open a network connection")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})


def test_offline_encoding_gives_tiktokens_real_count(no_network: None) -> None:
    assert encoding_name() == "cl100k_base_offline"
    assert count_tokens("hello world") == 2
    assert count_tokens("") == 0
    reference = tiktoken.get_encoding("cl100k_base_offline")
    text = "Summaries are rewritten, not appended: état, 日本語, emoji 🎹, code `x = 1`."
    assert count_tokens(text) == len(reference.encode(text))


@pytest.mark.parametrize("model", ["gpt-4", "gpt-3.5-turbo", "llama3", None])
def test_every_model_is_counted_offline(no_network: None, model: str | None) -> None:
    assert encoding_name(model) == "cl100k_base_offline"
    assert count_tokens("hello world", model) == 2


@pytest.mark.parametrize("model", ["gpt-4o-mini", "gpt-4o", "gpt-5-nano"])
def test_the_default_model_and_later_ones_are_counted_with_o200k_offline(
    no_network: None, model: str
) -> None:
    """They were counted with cl100k (o200k_base had no offline data): 12 tokens for a text
    that o200k makes 9 of."""
    assert encoding_name(model) == "o200k_base_offline"
    assert bundled_encodings.build("o200k_base").encode_ordinary("hello world") == [24912, 2375]
    assert count_tokens("Summaries are rewritten, état, 日本語", model) == 9
    assert count_tokens("Summaries are rewritten, état, 日本語", "gpt-4") == 12


def test_a_bundled_copy_that_fails_tiktokens_hash_is_not_used(
    no_network: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
    (tmp_path / hashlib.sha1(url.encode()).hexdigest()).write_bytes(b"aGVsbG8= 0\n")
    monkeypatch.setattr(bundled_encodings, "cache_directories", lambda: [tmp_path])
    with pytest.raises(ValueError, match="Hash mismatch"):
        bundled_encodings.build("o200k_base")
    with caplog.at_level(logging.INFO, logger="memory_worker.tokens"):
        assert encoding_name("gpt-4o-mini") == "cl100k_base_offline"
    assert "Hash mismatch" in caplog.text


def test_without_the_shipped_ranks_o200k_models_fall_back_to_cl100k(
    no_network: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bundled_encodings, "cache_directories", lambda: [])
    assert encoding_name("gpt-4o-mini") == "cl100k_base_offline"
    assert count_tokens("hello world", "gpt-4o-mini") == 2


@pytest.mark.parametrize("cache_name", [False, True], ids=["url-name", "tiktoken-cache-name"])
def test_ranks_in_tiktoken_ranks_dir_come_first(
    no_network: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache_name: bool
) -> None:
    url = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
    name = hashlib.sha1(url.encode()).hexdigest() if cache_name else "o200k_base.tiktoken"
    shutil.copy(bundled_encodings.SHIPPED / "o200k_base.tiktoken", tmp_path / name)
    monkeypatch.setenv("TIKTOKEN_RANKS_DIR", str(tmp_path))
    assert bundled_encodings.cache_directories() == [tmp_path, bundled_encodings.SHIPPED]
    monkeypatch.setattr(bundled_encodings, "SHIPPED", tmp_path / "absent")
    assert bundled_encodings.build.__wrapped__("o200k_base").name == "o200k_base_offline"


def test_the_package_ships_the_ranks() -> None:
    """Installed (pip install .), not only in a checkout: the default model's counts."""
    pyproject = tomllib.loads((bundled_encodings.SHIPPED.parents[1] / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]["memory_worker"]
    assert "encodings/*.tiktoken" in data
    assert (bundled_encodings.SHIPPED / "o200k_base.tiktoken").is_file()


def test_an_encoding_built_from_other_definitions_is_never_downloaded(no_network: None) -> None:
    # o200k_harmony calls o200k_base() itself, which would reach tiktoken's download.
    with pytest.raises(bundled_encodings.NotBundled):
        bundled_encodings.build("o200k_harmony")


def test_a_model_without_offline_data_is_logged_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bundled_encodings, "cache_directories", lambda: [])
    with caplog.at_level(logging.INFO, logger="memory_worker.tokens"):
        for _ in range(50):
            count_tokens("some text", "gpt-4o")
    notes = [record for record in caplog.records if "gpt-4o" in record.getMessage()]
    assert len(notes) == 1
    assert notes[0].levelno == logging.INFO
    assert "o200k_base" in notes[0].getMessage()


def test_special_token_text_is_counted_not_rejected() -> None:
    assert count_tokens("<|endoftext|>") > 1


def test_loader_failure_falls_back_to_chars_and_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_loader(name: str) -> tiktoken.Encoding:
        raise OSError("bundled encoding file missing")

    # tiktoken's own loader fails, as with a broken install; our cached wrapper sees that.
    monkeypatch.setattr(tokens.tiktoken, "get_encoding", broken_loader)
    with caplog.at_level(logging.INFO, logger="memory_worker.tokens"):
        counts = [
            count_tokens("x" * length, model) for length in range(200) for model in ("gpt-4", None)
        ]
    assert counts == [length // 4 for length in range(200) for _ in range(2)]
    assert encoding_name("gpt-4") == "chars/4"
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "len(text) // 4" in warnings[0].getMessage()


def test_missing_tiktoken_falls_back_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens, "tiktoken", None)
    assert count_tokens("abcdefghij", "gpt-4") == 2
    assert encoding_name() == "chars/4"
