"""Seeded, reproducible workloads made of real text of target token lengths.

A workload is a list of sessions: each session's requests run in order (one
user's turns); sessions are independent. Single-turn workloads (RAG, prefix
groups, trace replay) are one request per session. The load generator decides
the arrival process (closed loop, Poisson, trace timestamps), so the same
workload can be measured under any of them. Same seed, same prompts, always.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

from bench.loadgen import ChatRequest
from bench.prompts import text_of_tokens

RAG_SYSTEM = "Answer the question using only the document."


@dataclass(frozen=True)
class Workload:
    """Named sessions; ``timed`` when requests carry their own ``at_s`` (trace replay)."""

    name: str
    sessions: list[list[ChatRequest]]
    timed: bool = False
    description: str = ""

    @property
    def size(self) -> int:
        return sum(len(s) for s in self.sessions)

    def requests(self) -> list[ChatRequest]:
        """All requests, turn by turn across sessions (turn r of every session, then r+1)."""
        rounds = max((len(s) for s in self.sessions), default=0)
        return [s[r] for r in range(rounds) for s in self.sessions if r < len(s)]


def poisson_arrivals(requests: list[ChatRequest], qps: float, seed: int) -> list[ChatRequest]:
    """The same requests with seeded exponential inter-arrival gaps at ``qps``."""
    rng = random.Random(seed)
    t = 0.0
    out: list[ChatRequest] = []
    for req in requests:
        out.append(replace(req, at_s=t))
        t += rng.expovariate(qps)
    return out


def chat_workload(
    tokenizer_dir: Path,
    groups: int = 4,
    users_per_group: int = 4,
    rounds: int = 3,
    system_tokens: int = 1500,
    question_tokens: int = 40,
    answer_tokens: int = 16,
    seed: int = 0,
) -> Workload:
    """Shared system prompt per group + multi-turn chat with a growing history."""
    sessions = shared_prefix_sessions(
        tokenizer_dir, groups, users_per_group, rounds, system_tokens, question_tokens,
        answer_tokens, seed,
    )  # fmt: skip
    return Workload(
        "chat",
        sessions,
        description=f"{groups} system prompts of {system_tokens} tokens, "
        f"{groups * users_per_group} users x {rounds} turns",
    )


def shared_prefix_sessions(
    tokenizer_dir: Path,
    groups: int = 4,
    users_per_group: int = 4,
    rounds: int = 3,
    system_tokens: int = 1500,
    question_tokens: int = 40,
    answer_tokens: int = 16,
    seed: int = 0,
) -> list[list[ChatRequest]]:
    """Groups share a long system prompt; each user chats for ``rounds`` turns.

    The history grows each round (the previous question and a stand-in answer are
    appended), as in a multi-turn chat, so later turns share even longer prefixes.
    Sessions are interleaved across groups so concurrent users hit different groups.
    """
    rng = random.Random(seed)
    systems = [
        text_of_tokens(system_tokens, seed=f"chat-{seed}-{g}", tokenizer_dir=tokenizer_dir)
        for g in range(groups)
    ]
    sessions: list[list[ChatRequest]] = []
    for u in range(users_per_group):
        for g in range(groups):
            history = [{"role": "system", "content": systems[g]}]
            session: list[ChatRequest] = []
            for _ in range(rounds):
                q_seed = rng.randrange(1 << 30)
                question = text_of_tokens(question_tokens, seed=q_seed, tokenizer_dir=tokenizer_dir)
                history = [*history, {"role": "user", "content": question}]
                session.append(
                    ChatRequest(messages=list(history), max_tokens=answer_tokens, user=f"g{g}u{u}")
                )
                answer = text_of_tokens(answer_tokens, seed=q_seed + 1, tokenizer_dir=tokenizer_dir)
                history = [*history, {"role": "assistant", "content": answer}]
            sessions.append(session)
    return sessions


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of rank i (1-based) proportional to 1 / i**s."""
    return [1.0 / (i**s) for i in range(1, n + 1)]


def rag_workload(
    tokenizer_dir: Path,
    docs: int = 32,
    doc_tokens: int = 1900,
    requests: int = 120,
    zipf_s: float = 1.0,
    question_tokens: int = 48,
    answer_tokens: int = 16,
    seed: int = 0,
) -> Workload:
    """A corpus of ``docs`` documents; each request is one Zipf-drawn document + a question."""
    rng = random.Random(seed)
    corpus = [
        text_of_tokens(doc_tokens, seed=f"rag-{seed}-{d}", tokenizer_dir=tokenizer_dir)
        for d in range(docs)
    ]
    picks = rng.choices(range(docs), weights=zipf_weights(docs, zipf_s), k=requests)
    sessions = []
    for i, d in enumerate(picks):
        question = text_of_tokens(
            question_tokens, seed=f"rag-q-{seed}-{i}", tokenizer_dir=tokenizer_dir
        )
        messages = [
            {"role": "system", "content": RAG_SYSTEM},
            {"role": "user", "content": f"{corpus[d]}\n\nQuestion: {question}"},
        ]
        sessions.append([ChatRequest(messages=messages, max_tokens=answer_tokens, user=f"r{i}")])
    return Workload(
        "rag",
        sessions,
        description=f"{docs} documents of {doc_tokens} tokens, Zipf s={zipf_s}, "
        f"{requests} questions",
    )


def prefix_groups_workload(
    tokenizer_dir: Path,
    fleet_l0_tokens: int,
    k: float = 0.5,
    prefix_tokens: int = 1500,
    requests: int = 120,
    question_tokens: int = 48,
    answer_tokens: int = 16,
    seed: int = 0,
) -> Workload:
    """Groups sharing a prefix; total distinct prefix tokens = ``k`` x fleet L0 capacity.

    With k < 1 the whole prefix set fits the fleet's L0 only if it is partitioned
    across pods (what cache-aware routing does); with k > 1 it spills into L1/L2.
    """
    groups = max(1, round(k * fleet_l0_tokens / prefix_tokens))
    rng = random.Random(seed)
    prefixes = [
        text_of_tokens(prefix_tokens, seed=f"grp-{seed}-{g}", tokenizer_dir=tokenizer_dir)
        for g in range(groups)
    ]
    sessions = []
    for i in range(requests):
        g = rng.randrange(groups)
        question = text_of_tokens(
            question_tokens, seed=f"grp-q-{seed}-{i}", tokenizer_dir=tokenizer_dir
        )
        messages = [
            {"role": "system", "content": prefixes[g]},
            {"role": "user", "content": question},
        ]
        sessions.append([ChatRequest(messages=messages, max_tokens=answer_tokens, user=f"p{i}")])
    return Workload(
        "prefix",
        sessions,
        description=f"{groups} prefixes of {prefix_tokens} tokens (k={k} x fleet L0 "
        f"{fleet_l0_tokens} tokens), {requests} requests",
    )


def user_contexts_workload(
    tokenizer_dir: Path,
    users: int = 16,
    questions_per_user: int = 6,
    system_tokens: int = 1024,
    context_tokens: int = 512,
    question_tokens: int = 32,
    answer_tokens: int = 16,
    seed: int = 0,
    shuffled: bool = False,
) -> Workload:
    """One shared system prompt, then a context per user (their profile, a document),
    then a question: every request shares the system prompt, a user's requests share
    their context too. Made for open-loop arrivals: ``requests()`` interleaves users,
    the same order every round, so with an even number of users a round-robin over two
    pods sends each user's questions to one pod. ``shuffled``: each round's users in a
    seeded random order, as users do not take turns (then every request is a session of
    its own, in that order: for open-loop arrivals only)."""
    system = text_of_tokens(system_tokens, seed=f"users-sys-{seed}", tokenizer_dir=tokenizer_dir)
    sessions = []
    for u in range(users):
        context = text_of_tokens(
            context_tokens, seed=f"users-ctx-{seed}-{u}", tokenizer_dir=tokenizer_dir
        )
        turns = []
        for q in range(questions_per_user):
            question = text_of_tokens(
                question_tokens, seed=f"users-q-{seed}-{u}-{q}", tokenizer_dir=tokenizer_dir
            )
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"{context}\n\n{question}"},
            ]
            turns.append(ChatRequest(messages=messages, max_tokens=answer_tokens, user=f"u{u}"))
        sessions.append(turns)
    description = (
        f"a {system_tokens}-token system prompt, {users} users with "
        f"{context_tokens}-token contexts, {users * questions_per_user} questions"
    )
    if not shuffled:
        return Workload("users", sessions, description=description)
    rng = random.Random(f"users-order-{seed}")
    order = []
    for r in range(questions_per_user):
        round_ = [turns[r] for turns in sessions]
        rng.shuffle(round_)
        order += [[req] for req in round_]
    return Workload("users-shuffled", order, description=description + ", users in random order")
