"""URLs of the throughput benchmark's server: chatmem's own, plus two yardsticks on the same
stack (Django, DRF, token auth). Never mounted in production: the benchmark serves this URLconf
through ``bench.settings_proxy``.

- ``/bench/proxy``: a minimal stateless view that only forwards the message to the model and
  returns its reply.
- ``/bench/floor/<chat id>``: a turn that keeps the storage promises (docs/design.md) and does
  nothing else, what storing a turn costs on this stack before any memory work: claim the chat's
  turn slot and read its tail in one statement, call the model with that tail, then store both
  messages with adjacent seq from the counter and free the slot in one statement. No memory
  policy, folding, throttle, Redis, metrics or serializers; it never folds, so it reads the
  newest ``FLOOR_TAIL`` messages, about as many as a chatmem turn reads in the throughput
  benchmark (its tail runs from 40 to 70 messages).
"""

import uuid
from typing import Any

from django.db import connection
from django.urls import include, path
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from conversations.chat_model.tokens import count_tokens
from conversations.rows import NO_FLUSH_WAIT
from conversations.services.chat_backend import get_chat_model
from conversations.services.turn_model import release_pooled_connection
from conversations.variants import resolve_variant


class StatelessProxy(APIView):
    def post(self, request: Request) -> Response:
        data = request.data if isinstance(request.data, dict) else {}
        content = str(data.get("content", ""))
        variant = resolve_variant(None)
        # As a turn does: without it the pool, not the stack, would cap the proxy.
        release_pooled_connection()
        completion = get_chat_model().complete(
            [{"role": "user", "content": content}], variant.model
        )
        return Response({"content": completion.content}, status=201)


FLOOR_TAIL = 56

# The claim, as chatmem's: a conditional UPDATE of the chat row whose commit does not wait for a
# disk flush, with the tail read in the same statement.
FLOOR_CLAIM = f"""
WITH claimed AS (
    UPDATE conversations_chat SET turn_token = %s, turn_started_at = now()
    FROM {NO_FLUSH_WAIT}
    WHERE id = %s AND owner_id = %s AND turn_token IS NULL
    RETURNING id, system_prompt
)
SELECT claimed.system_prompt, brief.summary, (
    SELECT json_agg(json_build_array(tail.role, tail.content) ORDER BY tail.seq)
    FROM (
        SELECT seq, role, content FROM conversations_message
        WHERE chat_id = claimed.id ORDER BY seq DESC LIMIT {FLOOR_TAIL}
    ) AS tail
)
FROM claimed JOIN conversations_brief AS brief ON brief.chat_id = claimed.id
"""

# The append, as chatmem's: the counter advanced, both messages stored and the slot freed in
# one statement, atomic on its own.
FLOOR_APPEND = """
WITH counter AS (
    UPDATE conversations_chat
    SET last_seq = last_seq + 2, turn_token = NULL, turn_started_at = NULL, updated_at = now()
    WHERE id = %s AND turn_token = %s
    RETURNING id, last_seq
)
INSERT INTO conversations_message
    (chat_id, seq, role, content, token_count, model_variant, metadata, created_at)
SELECT id, last_seq - 1, 'user', %s, %s, '', '{}'::jsonb, now() FROM counter
UNION ALL
SELECT id, last_seq, 'assistant', %s, %s, %s, '{}'::jsonb, now() FROM counter
"""


class StatefulFloor(APIView):
    def post(self, request: Request, chat_id: int) -> Response:
        data = request.data if isinstance(request.data, dict) else {}
        content = str(data.get("content", ""))
        variant = resolve_variant(None)
        token = uuid.uuid4()
        with connection.cursor() as cursor:
            cursor.execute(FLOOR_CLAIM, [token, chat_id, request.user.pk])
            claimed = cursor.fetchone()
        if claimed is None:
            return Response({"detail": "no such chat, or a turn is in progress"}, status=409)
        system_prompt, summary, tail = claimed
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if summary:
            messages.append({"role": "system", "content": summary})
        messages.extend({"role": role, "content": text} for role, text in tail or ())
        messages.append({"role": "user", "content": content})
        release_pooled_connection()
        completion = get_chat_model().complete(messages, variant.model)
        with connection.cursor() as cursor:
            cursor.execute(
                FLOOR_APPEND,
                [
                    chat_id,
                    token,
                    content,
                    count_tokens(content, variant.model),
                    completion.content,
                    completion.completion_tokens,
                    variant.name,
                ],
            )
            stored = cursor.rowcount
        if stored != 2:
            return Response({"detail": "the turn slot was lost"}, status=409)
        return Response({"content": completion.content}, status=201)


urlpatterns: list[Any] = [
    path("bench/proxy", StatelessProxy.as_view()),
    path("bench/floor/<int:chat_id>", StatefulFloor.as_view()),
    path("", include("chatmem_project.urls")),
]
