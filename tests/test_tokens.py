"""Token counting: the offline tiktoken encoding, never a download, and the ``len(text) // 4``
fallback that warns once per process; a model's own tokenizer (a tiktoken encoding or a
tokenizer.json) and the margins, and chats in non-Latin scripts that stay within a model's window as
the model counts it (the fake server counting with its tokenizer)."""

import hashlib
import logging
import math
import shutil
import socket
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tiktoken

from bench.token_margin import smollm2_estimate
from conversations.chat_model import bundled_encodings, tokens
from conversations.chat_model.tokens import count_tokens, encoding_name
from tests.support.fake_openai import FakeOpenAI, last_user_text


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
    with caplog.at_level(logging.INFO, logger="conversations.chat_model.tokens"):
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
    pyproject = tomllib.loads((bundled_encodings.SHIPPED.parents[2] / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]["conversations"]
    assert "chat_model/encodings/*.tiktoken" in data
    assert (bundled_encodings.SHIPPED / "o200k_base.tiktoken").is_file()


def test_an_encoding_built_from_other_definitions_is_never_downloaded(no_network: None) -> None:
    # o200k_harmony calls o200k_base() itself, which would reach tiktoken's download.
    with pytest.raises(bundled_encodings.NotBundled):
        bundled_encodings.build("o200k_harmony")


def test_a_model_without_offline_data_is_logged_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bundled_encodings, "cache_directories", lambda: [])
    with caplog.at_level(logging.INFO, logger="conversations.chat_model.tokens"):
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
    with caplog.at_level(logging.INFO, logger="conversations.chat_model.tokens"):
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


# --------------------------------------------------------------------------------------------
# Counted for the model: a configured tokenizer, margins, and chats that stay in the window

SENTENCES = {
    "thai": "ผมชอบกินข้าวผัดกุ้งที่ร้านริมแม่น้ำเจ้าพระยาทุกวันเสาร์ตอนเย็นกับครอบครัว",
    "russian": "Мой код от шкафчика в спортзале четыре восемь два один, не забудь его.",  # noqa: RUF001
    "chinese": "我下个月要去里斯本出差，需要订一家离会议中心近的安静酒店，预算每晚一百五十欧元。",  # noqa: RUF001
}
ENGLISH = (
    "The quick brown fox jumps over the lazy dog while the summary keeps every fact the user "
    "gave: names, numbers, places, dates and the plans they made for the coming weeks."
)


def trained_tokenizer(path: Path) -> Path:
    """A byte-level BPE trained on English only, written as a Hugging Face tokenizer.json: it
    needs several times cl100k's tokens for Thai, Russian and Chinese, as a small model's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([ENGLISH] * 50, trainer)
    target = path / "tokenizer.json"
    tokenizer.save(str(target))
    return target


def file_counter(path: Path) -> Callable[[str], int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


# SmolLM2-135M's tokenizer by its measured ratios per script (docs/benchmarks.md).
smollm2_like_counter = smollm2_estimate


def test_a_configured_tokenizer_json_counts_as_the_model_does(
    tmp_path: Path, settings: Any
) -> None:
    path = trained_tokenizer(tmp_path)
    settings.MODEL_TOKENIZERS = f"local-model={path},other=o200k_base"
    reference = file_counter(path)
    for text in (*SENTENCES.values(), ENGLISH):
        assert count_tokens(text, "local-model") == reference(text)
    assert encoding_name("local-model") == f"tokenizer.json:{path}"
    assert encoding_name("other") == "o200k_base_offline"
    assert count_tokens(SENTENCES["thai"], "local-model") > 2 * count_tokens(SENTENCES["thai"])
    settings.TOKEN_COUNT_MARGIN = 1.5
    assert count_tokens(ENGLISH, "local-model") == math.ceil(reference(ENGLISH) * 1.5)


def test_an_unknown_model_counts_non_latin_text_over_and_latin_text_as_it_is(
    settings: Any,
) -> None:
    """No tokenizer configured: cl100k for the text, non-Latin runs weighted by the margin (over
    the largest measured ratio), so English chats keep their room."""
    assert count_tokens(ENGLISH, "smollm2") == count_tokens(ENGLISH, "gpt-4")
    for text in SENTENCES.values():
        assert count_tokens(text, "smollm2") >= smollm2_like_counter(text)
        assert count_tokens(text, "smollm2") >= 1.99 * count_tokens(text, "gpt-4")
        assert count_tokens(text, "gpt-4o") == count_tokens(text, "gpt-4o")  # known: exact
    settings.UNKNOWN_MODEL_NON_LATIN_MARGIN = 1.0
    assert count_tokens(SENTENCES["thai"], "smollm2") == count_tokens(SENTENCES["thai"], "gpt-4")


def test_a_tokenizer_that_cannot_be_loaded_is_a_settings_error(
    tmp_path: Path, settings: Any
) -> None:
    missing = tmp_path / "missing" / "tokenizer.json"
    problems = tokens.tokenizer_problems(f"local={missing},gpt=cl100k_base", 1.0, 2.0)
    assert len(problems) == 1 and "local's tokenizer" in problems[0]
    assert tokens.tokenizer_problems("no-equals-sign", 1.0, 2.0)[0].startswith("MODEL_TOKENIZERS")
    assert len(tokens.tokenizer_problems("", 0.9, 0.5)) == 2
    assert tokens.tokenizer_problems("", 1.0, 2.0) == []
    # At run time it is counted as an unknown model's, never a crash.
    for spec in (f"local={missing}", "malformed"):
        settings.MODEL_TOKENIZERS = spec
        thai = SENTENCES["thai"]
        assert count_tokens(thai, "local") == count_tokens(thai, "smollm2") > count_tokens(thai)


def multilingual_chat(api: Any, server: FakeOpenAI, turns: int) -> list[Any]:
    """A chat on the ``local`` variant in Thai, Russian and Chinese; the answers to its turns.
    Replies echo the user's message, so they are non-Latin too."""
    server.reply_fn = lambda body: last_user_text(body)
    created = api.post("/api/v1/chats/", {"model_variant": "local"}, format="json")
    assert created.status_code == 201, created.json()
    chat_id = created.json()["id"]
    answers = []
    languages = list(SENTENCES.values())
    for number in range(turns):
        content = f"{number}. {languages[number % 3]} {languages[(number + 1) % 3]}"
        response = api.post(f"/api/v1/chats/{chat_id}/turns/", {"content": content}, format="json")
        answers.append(response)
    return answers


WINDOW = 2400


@pytest.fixture
def local_model(settings: Any, use_fake_openai: FakeOpenAI) -> FakeOpenAI:
    settings.MODEL_VARIANTS = f"local=local-model:{WINDOW}"
    settings.MEMORY_SUMMARY_TOKEN_CAP = 300
    settings.MEMORY_SUMMARIZER_BACKEND = "offline"
    use_fake_openai.context_window = WINDOW
    return use_fake_openai


@pytest.mark.django_db
def test_a_chat_in_three_scripts_stays_within_a_configured_tokenizers_window(
    api: Any, settings: Any, local_model: FakeOpenAI, tmp_path: Path
) -> None:
    path = trained_tokenizer(tmp_path)
    settings.MODEL_TOKENIZERS = f"local-model={path}"
    local_model.prompt_counter = file_counter(path)
    answers = multilingual_chat(api, local_model, 24)
    assert [answer.status_code for answer in answers] == [201] * 24
    assert len(local_model.prompt_sizes) == 24
    # Folded as the window filled: near it, never at it.
    assert 0.7 * WINDOW < max(local_model.prompt_sizes) < WINDOW


@pytest.mark.django_db
def test_without_a_tokenizer_the_default_margin_keeps_the_chat_within_smollm2s_window(
    api: Any, local_model: FakeOpenAI
) -> None:
    local_model.prompt_counter = smollm2_like_counter
    answers = multilingual_chat(api, local_model, 24)
    assert [answer.status_code for answer in answers] == [201] * 24
    assert 0.7 * WINDOW < max(local_model.prompt_sizes) < WINDOW


@pytest.mark.django_db
def test_counted_as_cl100k_the_same_chat_overflows_and_is_told_not_to_retry(
    api: Any, settings: Any, local_model: FakeOpenAI
) -> None:
    """What the margin prevents: the model refuses the prompt (llama.cpp's 400), and the turn's
    502 says that sending it again cannot help."""
    settings.UNKNOWN_MODEL_NON_LATIN_MARGIN = 1.0
    local_model.prompt_counter = smollm2_like_counter
    answers = multilingual_chat(api, local_model, 24)
    refused = [answer for answer in answers if answer.status_code != 201]
    assert refused and any(size >= WINDOW for size in local_model.prompt_sizes)
    assert {answer.status_code for answer in refused} == {502}
    assert all(answer["x-should-retry"] == "false" for answer in refused)
    detail = refused[0].json()["detail"]
    assert "exceeds the available context size" in detail and "retry" not in detail
