"""bench.peers: the peers' own libraries on chatmem's workload. They are an optional extra
(``pip install -e '.[peers]'``, which CI installs), not part of the README's test install, so
without them this file is skipped; with them each peer is run for a few dozen turns."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain")
pytest.importorskip("langmem")
pytest.importorskip("llama_index.core")

from bench import cost, peers  # after the skip: it imports the libraries

TURNS = cost.build_workload(40, seed=7)


@pytest.mark.parametrize("name", list(peers.PEERS))
def test_each_peer_sends_one_prompt_per_turn_after_the_system_prompt(name: str) -> None:
    summaries = peers.Summaries()
    prompts = peers.PEERS[name](TURNS, summaries)
    assert len(prompts) == len(TURNS)
    assert all(p[0] == {"role": "system", "content": peers.SYSTEM_PROMPT} for p in prompts)
    if name == "plain sliding window":
        assert summaries.calls == 0
    else:
        assert summaries.calls > 0 and summaries.folded  # 40 turns pass the bound


def test_langmem_sometimes_sends_a_turn_without_its_own_message() -> None:
    """summarize_messages at seed 002's knobs: on some turns (turn 10 of this workload) the
    prompt is the summary alone, without the message the model is to answer; the other peers'
    prompts always end with it."""
    figures = {name: peers.measure(name, peer, [TURNS]) for name, peer in peers.PEERS.items()}
    assert figures["langmem summarize_messages"]["newest_not_verbatim"] > 0
    others = [f for name, f in figures.items() if name != "langmem summarize_messages"]
    assert all(f["newest_not_verbatim"] == 0 for f in others)


def test_the_window_drops_what_leaves_it_and_a_summary_buffer_folds_it() -> None:
    window = peers.measure("plain sliding window", peers.sliding_window, [TURNS])
    buffer = peers.measure(
        "LangChain ConversationSummaryBufferMemory", peers.summary_buffer_memory, [TURNS]
    )
    assert window["dropped_without_fold"] > 0
    assert buffer["dropped_without_fold"] == 0
    assert 0 < buffer["cached_share"] < 1
