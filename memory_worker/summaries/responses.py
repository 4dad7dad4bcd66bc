"""The Responses API summarizer: a hosted prompt id and version, which holds the model, its settings
and the instructions. Plain Python (no Django)."""

import logging
from collections.abc import Sequence
from typing import Any, cast

import openai

from conversations.chat_model.tokens import count_tokens
from conversations.chat_model.transport import redact, response_error_kind
from memory_worker.summaries.contract import (
    DEFAULT_CAP_TOKENS,
    FoldMessage,
    SummarizerError,
    SummaryResult,
    error_from_openai,
    format_fold_input,
    repair_request,
)
from memory_worker.summaries.validation import replaced_tokens, validate_summary

log = logging.getLogger(__name__)


class ResponsesSummarizer:
    """Summaries from the Responses API with a hosted prompt, given the fold's input as one
    ``input`` string (no model name: the prompt names it).

    The hosted prompt holds the model, its settings and the instructions, so no model name is
    sent, and there is no stricter retry: the instructions cannot be tightened from here without
    changing the exact input format. ``max_output_tokens`` is sent only when given.
    """

    name = "responses"

    def __init__(
        self,
        client: openai.OpenAI,
        prompt_id: str,
        prompt_version: str | None,
        cap_tokens: int = DEFAULT_CAP_TOKENS,
        timeout: float = 30.0,
        *,
        max_output_tokens: int | None = None,
    ) -> None:
        self.client = client
        self.prompt_id = prompt_id
        self.prompt_version = prompt_version
        self.cap_tokens = cap_tokens
        self.timeout = timeout
        self.max_output_tokens = max_output_tokens

    def summarize(
        self, current_summary: str, messages: Sequence[FoldMessage], pinned: Sequence[str] = ()
    ) -> SummaryResult:
        fold_input = format_fold_input(current_summary, messages, pinned)
        return self._result(self._call(fold_input), fold_input, current_summary, messages)

    def repair(
        self,
        current_summary: str,
        messages: Sequence[FoldMessage],
        draft: str,
        keep: Sequence[str],
        pinned: Sequence[str] = (),
    ) -> SummaryResult:
        """The fold guard's repair: the fold input unchanged as the first input item, the
        draft and what it lost after it; the hosted prompt's instructions stay as they are."""
        fold_input = format_fold_input(current_summary, messages, pinned)
        conversation = [
            {"role": "user", "content": fold_input},
            {"role": "assistant", "content": draft},
            {"role": "user", "content": repair_request(keep, self.cap_tokens)},
        ]
        return self._result(self._call(conversation), fold_input, current_summary, messages)

    def _result(
        self,
        response: Any,
        fold_input: str,
        current_summary: str,
        messages: Sequence[FoldMessage],
    ) -> SummaryResult:
        answered = getattr(response, "model", None)
        model = str(answered) if answered else None
        text = validate_summary(
            response.output_text,
            responses_finish_reason(response),
            self.cap_tokens,
            model,
            refusal=responses_refusal(response),
            # Counted as the summary is: with the model that answered.
            replaces=replaced_tokens(current_summary, messages, model),
        )
        usage = getattr(response, "usage", None)
        return SummaryResult(
            text,
            usage.input_tokens if usage else count_tokens(fold_input),
            usage.output_tokens if usage else count_tokens(text),
            self.name,
        )

    def prompt_reference(self) -> dict[str, str]:
        # Without a version the API uses the hosted prompt's current default version.
        reference = {"id": self.prompt_id}
        if self.prompt_version:
            reference["version"] = self.prompt_version
        return reference

    def _call(self, fold_input: str | list[dict[str, str]]) -> Any:
        options: dict[str, Any] = {}
        if self.max_output_tokens:
            options["max_output_tokens"] = self.max_output_tokens
        try:
            response = self.client.responses.create(
                prompt=cast(Any, self.prompt_reference()),
                input=cast(Any, fold_input),
                timeout=self.timeout,
                **options,
            )
        except openai.OpenAIError as error:
            raise error_from_openai(error) from error
        if getattr(response, "status", None) == "failed":
            raise failed_response_error(response)
        return response


def responses_finish_reason(response: Any) -> str:
    """The Chat Completions equivalent of a response's status, for ``validate_summary``."""
    if getattr(response, "status", None) != "incomplete":
        return "stop"
    details = getattr(response, "incomplete_details", None)
    if getattr(details, "reason", None) == "content_filter":
        return "content_filter"
    return "length"


def responses_refusal(response: Any) -> str | None:
    for item in getattr(response, "output", None) or []:
        for part in getattr(item, "content", None) or []:
            if getattr(part, "type", None) == "refusal":
                return str(getattr(part, "refusal", "") or "refused")
    return None


def failed_response_error(response: Any) -> SummarizerError:
    error = getattr(response, "error", None)
    code = str(getattr(error, "code", "") or "")
    message = redact(str(getattr(error, "message", "") or ""))
    kind = response_error_kind(code)
    # The provider's words go to the log only, as error_from_openai does for everything but a
    # refused request: a rate limit's names the operator's organisation, and the fold's error
    # is shown to the chat's owner.
    log.warning("summarizer response failed: %s %s", code, message, extra={"error_kind": kind})
    return SummarizerError(kind, f"summarizer response failed: {code or 'no error code'}")
