"""The chat list's query parameters (GET /api/v1/chats/): ?search= in titles, ?policy=,
?degraded=, ?ordering= among an allow-list. A parameter the list cannot honour is a 400 naming
it, never silently ignored."""

from typing import Any

import pytest

from conversations.models import Brief, Chat

pytestmark = pytest.mark.django_db


def new_chat(api: Any, title: str, policy: str = "sliding-window") -> int:
    response = api.post("/api/v1/chats/", {"title": title, "policy": policy}, format="json")
    assert response.status_code == 201, response.content
    return int(response.json()["id"])


def titles(api: Any, query: str) -> list[str]:
    response = api.get(f"/api/v1/chats/?{query}")
    assert response.status_code == 200, response.content
    return [chat["title"] for chat in response.json()["results"]]


@pytest.fixture
def three_chats(api: Any) -> dict[str, int]:
    return {
        "Trip to Lisbon": new_chat(api, "Trip to Lisbon", "contract"),
        "Tax return 2026": new_chat(api, "Tax return 2026"),
        "Lisbon flat hunt": new_chat(api, "Lisbon flat hunt", "chunked"),
    }


def test_search_finds_titles_with_every_word_in_any_case(
    api: Any, three_chats: dict[str, int]
) -> None:
    assert titles(api, "search=lisbon") == ["Lisbon flat hunt", "Trip to Lisbon"]
    assert titles(api, "search=Hunt") == ["Lisbon flat hunt"]
    assert titles(api, "search=LISBON+trip") == ["Trip to Lisbon"]
    assert titles(api, "search=berlin") == []
    assert len(titles(api, "search=")) == 3


def test_filter_by_policy(api: Any, three_chats: dict[str, int]) -> None:
    assert titles(api, "policy=contract") == ["Trip to Lisbon"]
    assert titles(api, "policy=token-budget") == []


def test_filter_by_degraded_memory(api: Any, three_chats: dict[str, int]) -> None:
    Brief.objects.filter(chat_id=three_chats["Tax return 2026"]).update(degraded=True)
    assert titles(api, "degraded=true") == ["Tax return 2026"]
    assert titles(api, "degraded=false") == ["Lisbon flat hunt", "Trip to Lisbon"]


def test_filters_combine(api: Any, three_chats: dict[str, int]) -> None:
    Brief.objects.filter(chat_id=three_chats["Trip to Lisbon"]).update(degraded=True)
    assert titles(api, "search=lisbon&degraded=true&policy=contract") == ["Trip to Lisbon"]
    assert titles(api, "search=lisbon&degraded=true&policy=chunked") == []


def test_ordering_by_each_allowed_field(api: Any, three_chats: dict[str, int]) -> None:
    newest_first = ["Lisbon flat hunt", "Tax return 2026", "Trip to Lisbon"]
    assert titles(api, "") == titles(api, "ordering=") == newest_first
    assert titles(api, "ordering=created_at") == newest_first[::-1]
    assert titles(api, "ordering=title") == [
        "Lisbon flat hunt",
        "Tax return 2026",
        "Trip to Lisbon",
    ]
    assert titles(api, "ordering=-title,id") == [
        "Trip to Lisbon",
        "Tax return 2026",
        "Lisbon flat hunt",
    ]
    assert titles(api, "ordering=-id") == newest_first
    # A rename touches updated_at: the renamed chat comes first, recently updated first.
    renamed = api.patch(
        f"/api/v1/chats/{three_chats['Trip to Lisbon']}/", {"title": "Trip"}, format="json"
    )
    assert renamed.status_code == 200
    assert titles(api, "ordering=-updated_at")[0] == "Trip"
    assert titles(api, "ordering=updated_at")[-1] == "Trip"


def test_ties_are_broken_by_id_so_pages_do_not_overlap(api: Any) -> None:
    ids = [new_chat(api, "same") for _ in range(5)]
    first = api.get("/api/v1/chats/?ordering=title&page_size=2").json()
    second = api.get("/api/v1/chats/?ordering=title&page_size=2&page=2").json()
    third = api.get("/api/v1/chats/?ordering=title&page_size=2&page=3").json()
    seen = [chat["id"] for page in (first, second, third) for chat in page["results"]]
    assert seen == sorted(ids, reverse=True)


@pytest.mark.parametrize(
    ("query", "parameter", "says"),
    [
        ("ordering=last_seq", "ordering", "Cannot order by 'last_seq'"),
        ("ordering=title,-owner", "ordering", "Cannot order by '-owner'"),
        ("ordering=updated", "ordering", "order by title, created_at, updated_at, id"),
        ("policy=nope", "policy", '"nope" is not a policy; the policies: chunked, contract,'),
        ("degraded=yes", "degraded", '"yes" is not true or false'),
    ],
)
def test_a_parameter_the_list_cannot_honour_is_a_400_naming_it(
    api: Any, query: str, parameter: str, says: str
) -> None:
    new_chat(api, "one")
    response = api.get(f"/api/v1/chats/?{query}")
    assert response.status_code == 400, response.content
    assert says in response.json()[parameter][0]


def test_filters_never_reach_another_users_chats(
    api: Any, other_api: Any, three_chats: dict[str, int]
) -> None:
    assert titles(other_api, "search=lisbon") == []
    assert titles(other_api, "ordering=title&policy=contract") == []
    assert Chat.objects.count() == 3
