"""Workloads are seeded, reproducible and hit their token targets under the pods' tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.prompts import count_tokens, text_of_tokens, token_block
from bench.tinymodel import ensure_tokenizer
from bench.trace import DEFAULT_TRACE, load_trace, trace_workload
from bench.workloads import (
    chat_workload,
    poisson_arrivals,
    prefix_groups_workload,
    rag_workload,
    user_contexts_workload,
)


@pytest.fixture(scope="module")
def tok() -> Path:
    return ensure_tokenizer()


def _contents(workload) -> list[str]:
    return [m["content"] for r in workload.requests() for m in r.messages]


@pytest.mark.parametrize("n", [1, 7, 48, 512, 1900, 4000])
def test_text_of_tokens_has_exactly_the_target_token_count(tok, n):
    assert count_tokens(text_of_tokens(n, seed=n, tokenizer_dir=tok), tok) == n


def test_token_blocks_concatenate_to_the_sum_of_their_lengths(tok):
    a, b = token_block(512, "a", tok), token_block(300, "b", tok)
    assert count_tokens(a.text + b.text, tok) == 812
    assert count_tokens(a.text + b.exact_head(100, " cache"), tok) == 612


def test_same_seed_gives_identical_prompts_and_another_seed_does_not(tok):
    one = rag_workload(tok, docs=4, requests=10, seed=3)
    two = rag_workload(tok, docs=4, requests=10, seed=3)
    other = rag_workload(tok, docs=4, requests=10, seed=4)
    assert _contents(one) == _contents(two)
    assert _contents(one) != _contents(other)


def test_rag_documents_are_within_two_percent_of_1900_tokens_and_zipf_skewed(tok):
    w = rag_workload(tok, docs=8, doc_tokens=1900, requests=200, zipf_s=1.2, seed=0)
    docs = [r.messages[1]["content"].split("\n\nQuestion:")[0] for r in w.requests()]
    assert all(abs(count_tokens(d, tok) - 1900) <= 38 for d in set(docs))
    counts = sorted((docs.count(d) for d in set(docs)), reverse=True)
    assert counts[0] > 3 * counts[-1]  # the most popular document dominates the least


def test_prefix_groups_are_sized_from_fleet_l0_capacity(tok):
    w = prefix_groups_workload(tok, fleet_l0_tokens=40_000, k=0.5, prefix_tokens=2000, requests=60)
    systems = {r.messages[0]["content"] for r in w.requests()}
    assert len(systems) == 10  # 0.5 x 40,000 / 2,000
    assert all(count_tokens(s, tok) == 2000 for s in systems)


def test_chat_history_grows_each_turn_and_keeps_the_previous_turns_as_prefix(tok):
    w = chat_workload(tok, groups=2, users_per_group=1, rounds=3, system_tokens=200)
    session = w.sessions[0]
    assert [len(r.messages) for r in session] == [2, 4, 6]
    assert session[2].messages[:4] == session[1].messages
    assert session[1].messages[:2] == session[0].messages


def test_poisson_arrivals_are_seeded_and_average_the_requested_rate(tok):
    reqs = rag_workload(tok, docs=2, requests=400, seed=1).requests()
    timed = poisson_arrivals(reqs, qps=20.0, seed=5)
    assert [r.at_s for r in timed] == [r.at_s for r in poisson_arrivals(reqs, 20.0, seed=5)]
    assert 400 / timed[-1].at_s == pytest.approx(20.0, rel=0.15)


def _write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    return path


def test_trace_replay_keeps_shared_hash_id_prefixes_as_shared_text(tok, tmp_path):
    trace = _write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 1000, "input_length": 1200, "output_length": 5, "hash_ids": [1, 2, 3]},
            {"timestamp": 3000, "input_length": 1100, "output_length": 9, "hash_ids": [1, 2, 4]},
            {"timestamp": 5000, "input_length": 700, "output_length": 2, "hash_ids": [5, 6]},
        ],
    )
    w = trace_workload(tok, trace, requests=None, speedup=2.0, tokens_per_hash=512)
    a, b, c = (r.messages[0]["content"] for r in w.requests())
    shared = token_block(512, "trace-0-1", tok).text + token_block(512, "trace-0-2", tok).text
    assert a.startswith(shared) and b.startswith(shared) and not c.startswith(shared[:50])
    assert [count_tokens(x, tok) for x in (a, b, c)] == [1200, 1100, 700]
    assert [r.at_s for r in w.requests()] == [0.0, 1.0, 2.0]
    assert [r.max_tokens for r in w.requests()] == [5, 9, 2]
    assert "1 bad lines skipped" in w.description


def test_trace_scaling_shrinks_lengths_in_proportion(tok, tmp_path):
    trace = _write_trace(
        tmp_path / "t.jsonl",
        [{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [7, 8]}],
    )
    w = trace_workload(tok, trace, tokens_per_hash=64)
    assert count_tokens(w.requests()[0].messages[0]["content"], tok) == 128


def test_the_shared_mooncake_trace_loads_without_bad_lines():
    if not DEFAULT_TRACE.exists():
        pytest.skip(f"the Mooncake trace is not on this machine ({DEFAULT_TRACE}; KVGATE_TRACE)")
    load = load_trace(DEFAULT_TRACE, limit=500)
    assert len(load.rows) == 500 and load.skipped == 0


def test_shuffled_users_send_the_same_questions_each_round_in_another_order(tok):
    """In plain ``users`` the users take turns, so a round-robin over two pods sends each
    user's questions to one pod (16 is even); shuffled, they do not."""
    kw = dict(users=8, questions_per_user=4, system_tokens=64, context_tokens=32)
    plain = user_contexts_workload(tok, seed=5, **kw).requests()
    mixed_w = user_contexts_workload(tok, seed=5, shuffled=True, **kw)
    mixed = mixed_w.requests()
    assert mixed_w.name == "users-shuffled" and all(len(s) == 1 for s in mixed_w.sessions)
    assert len(mixed) == len(plain) == 32
    for r in range(4):  # each round: the same 8 questions, another order
        plain_round, mixed_round = plain[8 * r : 8 * r + 8], mixed[8 * r : 8 * r + 8]
        assert sorted(q.user for q in mixed_round) == sorted(q.user for q in plain_round)
        assert {str(q.messages) for q in mixed_round} == {str(q.messages) for q in plain_round}
    assert [q.user for q in mixed] != [q.user for q in plain]
    pods_of = {}
    for i, q in enumerate(plain):
        pods_of.setdefault(q.user, set()).add(i % 2)
    assert all(len(p) == 1 for p in pods_of.values())  # round-robin: one pod a user
    pods_of = {}
    for i, q in enumerate(mixed):
        pods_of.setdefault(q.user, set()).add(i % 2)
    assert any(len(p) == 2 for p in pods_of.values())
    again = user_contexts_workload(tok, seed=5, shuffled=True, **kw).requests()
    assert [q.user for q in again] == [q.user for q in mixed]  # seeded
