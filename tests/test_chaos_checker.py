"""The chaos script's ledger checker (bench/chaos.py), on synthetic ledgers: a sound chat passes,
and each kind of damage the chaos run must catch is reported. No database needed."""

from dataclasses import replace

import pytest

from bench.chaos import ChatRecord, LedgerRow, ledger_violations, sampled_decreases, split


def fold(
    from_seq: int, to_seq: int, version: int, at: float | None, status: str = "succeeded"
) -> LedgerRow:
    return LedgerRow(status, from_seq, to_seq, version, at)


SOUND = ChatRecord(
    chat_id=7,
    acknowledged_turns=10,
    message_seqs=tuple(range(1, 21)),
    last_seq=20,
    watermark=14,
    version=2,
    ledger=(
        fold(1, 8, 0, 100.0),
        fold(1, 8, 0, 101.0, "superseded"),  # a stale duplicate wrote nothing: fine
        fold(9, 12, 1, 102.0, "failed"),  # a failed attempt, retried later: fine
        fold(9, 14, 1, 103.0),
        fold(15, 20, 2, None, "running"),  # a killed worker's row: nothing committed
    ),
)


def test_a_sound_chat_passes() -> None:
    assert ledger_violations(SOUND) == []


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ({"ledger": (fold(1, 8, 0, 100.0), fold(8, 14, 1, 103.0))}, "overlaps"),
        ({"ledger": (fold(1, 8, 0, 100.0), fold(10, 14, 1, 103.0))}, "gap: 9..9"),
        ({"watermark": 12}, "W = 12"),
        ({"acknowledged_turns": 11}, "11 turns acknowledged"),
        ({"message_seqs": (*range(1, 5), *range(6, 21))}, "not numbered"),
        ({"version": 3}, "version 3 != 2"),
        # Both folds committed on version 0: the fencing UPDATE would have stopped the second.
        ({"ledger": (fold(1, 8, 0, 100.0), fold(9, 14, 0, 103.0))}, "base versions"),
        # The later commit moved W back (ranges still tile 1..14).
        ({"ledger": (fold(9, 14, 0, 100.0), fold(1, 8, 1, 103.0))}, "W in commit order"),
        ({"ledger": (fold(1, 8, 0, 105.0), fold(9, 14, 1, 103.0))}, "W in time"),
        ({"watermark": 22, "ledger": (fold(1, 22, 0, 1.0),), "version": 1}, "beyond"),
    ],
)
def test_damage_is_reported(damage: dict[str, object], expected: str) -> None:
    problems = ledger_violations(replace(SOUND, **damage))  # type: ignore[arg-type]
    assert problems, damage
    assert any(expected in problem for problem in problems), problems
    assert all(problem.startswith("chat 7: ") for problem in problems)


def test_sampled_watermarks_must_never_decrease() -> None:
    assert sampled_decreases([{1: 0, 2: 0}, {1: 8, 2: 0}, {1: 8, 2: 6}]) == []
    assert sampled_decreases([{1: 8}, {1: 6}, {1: 8}]) == ["chat 1: W sampled 8 then 6"]


def test_chats_are_split_across_clients() -> None:
    assert split([1, 2, 3, 4, 5], 2) == [[1, 3, 5], [2, 4]]
    assert split([1], 3) == [[1]]
