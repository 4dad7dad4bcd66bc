"""The Chat Completions summarizer: any OpenAI-compatible endpoint (OpenAI, vLLM, Ollama...),
with our instructions, one stricter retry of an over-cap summary and the fold guard's repair.
Plain Python (no Django)."""

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import openai

from conversations.chat_model.tokens import count_tokens
from conversations.chat_model.transport import TokenLimitField, create_chat_completion, token_limit
from memory_worker.summaries.contract import (
    DEFAULT_CAP_TOKENS,
    FoldMessage,
    SummarizerError,
    SummaryResult,
    error_from_openai,
    format_fold_input,
    repair_request,
    shorten_request,
    summary_instructions,
)
from memory_worker.summaries.validation import replaced_tokens, validate_summary

log = logging.getLogger(__name__)

# Room for the completion beyond the cap, so an over-long summary comes back whole and is
# rejected by counting ("over_cap") instead of arriving cut off ("truncated").
OUTPUT_LIMIT_FACTOR = 1.5


@dataclass(frozen=True)
class Draft:
    """One summarizer call's raw output, before validation."""

    text: str
    finish_reason: str | None
    refusal: str | None
    input_tokens: int
    output_tokens: int


class ChatCompletionsSummarizer:
    """Summaries from any OpenAI-compatible Chat Completions endpoint (OpenAI, vLLM, Ollama...).

    ``token_limit_field``: where the output limit goes, the field the endpoint honours
    (chat_model.transport.token_limit_field). Over-cap output is caught by counting all the same.
    """

    name = "chat"
    takes_pins = True  # summarizers.PinAwareSummarizer

    def __init__(
        self,
        client: openai.OpenAI,
        model: str,
        cap_tokens: int = DEFAULT_CAP_TOKENS,
        timeout: float = 30.0,
        *,
        output_token_limit: int | None = None,
        token_limit_field: TokenLimitField = "max_completion_tokens",
        strict: bool = False,
    ) -> None:
        self.client = client
        self.model = model
        self.cap_tokens = cap_tokens
        self.timeout = timeout
        self.output_token_limit = output_token_limit or round(cap_tokens * OUTPUT_LIMIT_FACTOR)
        self.token_limit_field = token_limit_field
        self.strict = strict  # the stricter prompt: the retry after an invalid summary

    def summarize(
        self, current_summary: str, messages: Sequence[FoldMessage], pinned: Sequence[str] = ()
    ) -> SummaryResult:
        conversation = self._conversation(current_summary, messages, pinned)
        replaces = replaced_tokens(current_summary, messages, self.model)
        first = self._call(conversation)
        try:
            return self._result(first, replaces)
        except SummarizerError as error:
            if error.kind != "over_cap":
                raise
        # One stricter retry: the model shortens its own draft, which usually lands under the cap.
        draft_tokens = count_tokens(first.text, self.model)
        log.info(
            "summary over cap, retrying once with a stricter limit",
            extra={"summary_tokens": draft_tokens, "cap_tokens": self.cap_tokens},
        )
        retry = self._call(
            [
                *conversation,
                {"role": "assistant", "content": first.text},
                {"role": "user", "content": shorten_request(draft_tokens, self.cap_tokens)},
            ]
        )
        result = self._result(retry, replaces)
        return SummaryResult(
            result.text,
            first.input_tokens + retry.input_tokens,
            first.output_tokens + retry.output_tokens,
            self.name,
            calls=2,
        )

    def repair(
        self,
        current_summary: str,
        messages: Sequence[FoldMessage],
        draft: str,
        keep: Sequence[str],
        pinned: Sequence[str] = (),
    ) -> SummaryResult:
        """The fold guard's repair: the model corrects its own draft, as in the stricter retry,
        so the request names only what is missing."""
        return self._result(
            self._call(
                [
                    *self._conversation(current_summary, messages, pinned),
                    {"role": "assistant", "content": draft},
                    {"role": "user", "content": repair_request(keep, self.cap_tokens)},
                ]
            ),
            replaced_tokens(current_summary, messages, self.model),
        )

    def _conversation(
        self, current_summary: str, messages: Sequence[FoldMessage], pinned: Sequence[str]
    ) -> list[dict[str, str]]:
        return [
            {
                "role": "system",
                "content": summary_instructions(self.cap_tokens, strict=self.strict),
            },
            {"role": "user", "content": format_fold_input(current_summary, messages, pinned)},
        ]

    def _call(self, conversation: list[dict[str, str]]) -> Draft:
        limit = token_limit(self.token_limit_field, self.output_token_limit)
        try:
            response = create_chat_completion(
                self.client, {"model": self.model, "messages": conversation, **limit}, self.timeout
            )
        except openai.OpenAIError as error:
            raise error_from_openai(error) from error
        if not response.choices:
            raise SummarizerError("empty", "summarizer response had no choices")
        choice = response.choices[0]
        text = choice.message.content or ""
        usage = response.usage
        return Draft(
            text=text,
            finish_reason=choice.finish_reason,
            refusal=getattr(choice.message, "refusal", None),
            input_tokens=usage.prompt_tokens if usage else self._count_input(conversation),
            output_tokens=usage.completion_tokens if usage else count_tokens(text, self.model),
        )

    def _count_input(self, conversation: list[dict[str, str]]) -> int:
        return sum(count_tokens(message["content"], self.model) for message in conversation)

    def _result(self, draft: Draft, replaces: int) -> SummaryResult:
        text = validate_summary(
            draft.text,
            draft.finish_reason,
            self.cap_tokens,
            self.model,
            refusal=draft.refusal,
            headings=True,
            replaces=replaces,
        )
        return SummaryResult(text, draft.input_tokens, draft.output_tokens, self.name)
