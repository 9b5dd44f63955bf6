"""A large embedding backlog shares the engine's steps like any prefill (issue 45.6): its prompts are computed in chunks
within max_num_batched_tokens, a running chat takes a token in every one of those steps, and a chat that arrives
behind the backlog waits only for the prompts ahead of it, chunk by chunk. Counted in steps, on the simulated engine
(the production scheduler over a cost model)."""
from __future__ import annotations

import math

from kvgate.engine import PoolingParams, SamplingParams
from kvgate.engine.simulated import SimulatedEngine

BUDGET = 2048
EMBEDDINGS, PROMPT = 64, 500  # 32,000 prompt tokens: 16 steps' budget


def engine() -> SimulatedEngine:
    return SimulatedEngine(4096, max_num_seqs=256, max_num_batched_tokens=BUDGET, sleep=False)


def queue_backlog(e: SimulatedEngine) -> None:
    for i in range(EMBEDDINGS):
        e.add_embedding_request(f"embed-{i}", [7 + i] * PROMPT, PoolingParams())


def test_a_running_chat_decodes_every_step_while_a_large_embedding_backlog_prefills_in_chunks():
    e = engine()
    e.add_request("chat", [1, 2], SamplingParams(max_tokens=500, ignore_eos=True))
    e.step()  # the chat's prompt and first token
    queue_backlog(e)
    steps, embedded = 0, 0
    while embedded < EMBEDDINGS:
        outputs = e.step()
        steps += 1
        chat = [o for o in outputs if o.request_id == "chat"]
        assert len(chat) == 1 and len(chat[0].new_token_ids) == 1, f"step {steps}: the chat took no token"
        embedded += sum(o.embedding is not None for o in outputs)
    # every prompt token computed within the budget beside the chat's one: the backlog took as many steps as that
    assert steps == math.ceil(EMBEDDINGS * PROMPT / (BUDGET - 1))


def test_a_chat_arriving_behind_the_backlog_starts_once_the_prompts_ahead_of_it_are_computed():
    e = engine()
    queue_backlog(e)
    e.add_request("late", [1, 2], SamplingParams(max_tokens=4, ignore_eos=True))
    for step in range(1, 100):
        if any(o.request_id == "late" and o.new_token_ids for o in e.step()):
            break
    assert step == math.ceil((EMBEDDINGS * PROMPT + 2) / BUDGET)  # not after the backlog's every step: in its last
