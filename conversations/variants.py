"""Model variants a turn may choose (a deep-dive model beside the everyday one). Memory is
model-agnostic; a variant's context window only feeds the token-budget trigger."""

import logging
from dataclasses import dataclass
from functools import lru_cache

from django.conf import settings

DEFAULT_VARIANT = "default"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelVariant:
    name: str
    model: str
    context_tokens: int


class UnknownVariant(ValueError):
    pass


@lru_cache(maxsize=8)
def _parse_variants(spec: str, default_model: str, default_context: int) -> dict[str, ModelVariant]:
    variants = {DEFAULT_VARIANT: ModelVariant(DEFAULT_VARIANT, default_model, default_context)}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, target = item.partition("=")
        model, _, context = target.partition(":")
        if not sep or not name.strip() or not model.strip():
            raise ValueError(
                f"MODEL_VARIANTS entry {item!r} must look like name=model[:context_tokens]"
            )
        tokens = context_tokens(item, context) if context.strip() else default_context
        variants[name.strip()] = ModelVariant(name.strip(), model.strip(), tokens)
    return variants


def context_tokens(item: str, context: str) -> int:
    digits = context.strip()
    tokens = int(digits) if digits.isascii() and digits.isdigit() else 0
    if tokens < 1:
        raise ValueError(
            f"MODEL_VARIANTS entry {item!r}: the context window after the colon must be a "
            "positive number of tokens"
        )
    return tokens


def model_variants() -> dict[str, ModelVariant]:
    return _parse_variants(
        settings.MODEL_VARIANTS, settings.CHAT_MODEL, settings.CHAT_MODEL_CONTEXT_TOKENS
    )


def resolve_variant(name: str | None) -> ModelVariant:
    variants = model_variants()
    key = name or DEFAULT_VARIANT
    if key not in variants:
        known = ", ".join(sorted(variants))
        raise UnknownVariant(f'Unknown model_variant "{key}". Known variants: {known}.')
    return variants[key]


def turn_variant(requested: str | None, chat_default: str) -> ModelVariant:
    """The variant a turn runs on: the one it asked for (UnknownVariant, the client's 400, if
    not configured), else the chat's default. A chat's default that the operator has since
    removed from MODEL_VARIANTS falls back to the configured default, logged: the chat was
    valid when it was saved, and its user did not ask for the variant on this turn."""
    if requested:
        return resolve_variant(requested)
    return chat_variant(chat_default)


def chat_variant(chat_default: str) -> ModelVariant:
    try:
        return resolve_variant(chat_default or None)
    except UnknownVariant:
        log.warning(
            "a chat's model_variant is not in MODEL_VARIANTS; using the default variant",
            extra={"event": "variant_removed", "model_variant": chat_default},
        )
        return resolve_variant(None)
