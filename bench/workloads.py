"""Seeded, reproducible workloads made of real text of target token lengths."""

from __future__ import annotations

import random
from pathlib import Path

from bench.loadgen import ChatRequest
from bench.prompts import text_of_tokens


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
        text_of_tokens(system_tokens, seed=seed * 1000 + g, tokenizer_dir=tokenizer_dir)
        for g in range(groups)
    ]
    sessions: list[list[ChatRequest]] = []
    for u in range(users_per_group):
        for g in range(groups):
            history = [{"role": "system", "content": systems[g]}]
            session: list[ChatRequest] = []
            for r in range(rounds):
                q_seed = rng.randrange(1 << 30)
                question = text_of_tokens(question_tokens, seed=q_seed, tokenizer_dir=tokenizer_dir)
                history = [*history, {"role": "user", "content": question}]
                session.append(
                    ChatRequest(messages=list(history), max_tokens=answer_tokens, user=f"g{g}u{u}")
                )
                answer = text_of_tokens(answer_tokens, seed=q_seed + 1, tokenizer_dir=tokenizer_dir)
                history = [*history, {"role": "assistant", "content": answer}]
                del r
            sessions.append(session)
    return sessions
