"""Token authentication as DRF's, with the token and its user read in one plain query; the same
tokens under the ``Bearer`` scheme too.

Every API request authenticates, so the lookup is on every turn's path: conversations.rows does
it for less CPU than the ORM's ``select_related("user").get(key=...)``. Same answers: an unknown
key and an inactive user fail with DRF's own messages, and ``request.auth`` is the Token with its
user attached."""

from typing import Any, cast

from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import Field
from django.utils.translation import gettext_lazy as _
from rest_framework import authentication, exceptions
from rest_framework.authtoken.models import Token

from conversations import rows


class TokenAuthentication(authentication.TokenAuthentication):
    def authenticate_credentials(self, key: str) -> tuple[Any, Any]:
        token_model = cast(type[Token], self.get_model())
        user_model = get_user_model()
        token_fields = rows.selected_fields(token_model)
        user_fields = rows.selected_fields(user_model)
        quote = connection.ops.quote_name
        token_key = quote(str(token_model._meta.pk.column))  # type: ignore[union-attr]
        user_fk = quote(str(cast(Field, token_model._meta.get_field("user")).column))
        user_pk = quote(str(user_model._meta.pk.column))  # type: ignore[union-attr]
        found = rows.fetch_instances(
            token_model,
            token_fields,
            f"SELECT {rows.column_list(token_fields, 't')}, {rows.column_list(user_fields, 'u')} "
            f"FROM {rows.quoted_table(token_model)} t "
            f"JOIN {rows.quoted_table(user_model)} u ON u.{user_pk} = t.{user_fk} "
            f"WHERE t.{token_key} = %s",
            [key],
        )
        if not found:
            raise exceptions.AuthenticationFailed(_("Invalid token."))
        token, user_values = found[0]
        user = rows.build_instance(user_model, user_fields, user_values)
        if not user.is_active:
            raise exceptions.AuthenticationFailed(_("User inactive or deleted."))
        token.user = user
        return (user, token)


class BearerTokenAuthentication(TokenAuthentication):
    """The same tokens sent the way the OpenAI SDKs send an API key (``Authorization: Bearer``):
    what /v1 takes, and what the REST API takes beside ``Token``, so one header works on both."""

    keyword = "Bearer"
