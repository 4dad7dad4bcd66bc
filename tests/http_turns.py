"""A turn request sent by hand over ``http.client``, for tests against a real server (uvicorn,
gunicorn) where Django's test client cannot go."""

import http.client
import json
from typing import Any


def send_turn(
    connection: http.client.HTTPConnection,
    token: str,
    chat_id: int,
    body: dict[str, Any],
    accept: str,
) -> None:
    connection.request(
        "POST",
        f"/api/v1/chats/{chat_id}/turns/",
        body=json.dumps(body),
        headers={
            "Authorization": f"Token {token}",
            "Content-Type": "application/json",
            "Accept": accept,
        },
    )
