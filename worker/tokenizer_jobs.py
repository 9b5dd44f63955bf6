"""Tokenize and detokenize jobs: answered at intake from the worker's own tokenizer, never run by the engine.

The gateway has no tokenizer (it does not import transformers), and the answer must be the serving worker's: the
same tokenizer files, the same chat template, the same `encode_chat` a generation job's messages go through. So
these are jobs like any other (one stream per model, the worker group, a final event in the reply stream) that a
worker answers as soon as it reads them, with no KV blocks and no engine step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvgate.producer.protocol import Job
from kvgate.worker.engine import Engine


@dataclass(slots=True)
class Tokenized:
    """A tokenizer job's answer: tokenize fills token_ids, detokenize text."""

    token_ids: list[int]
    text: str
    max_model_len: int


def answer(engine: Engine, job: Job, chat: Callable[[Job], list[int]] | None = None) -> Tokenized:
    """The answer to a tokenize or detokenize job; a tokenizer or template that refuses the input raises (an error
    result naming it). `chat`: how the worker renders a generation job's messages (tool calls and answers in them
    included), so a tokenize job counts what a generation job would be given."""
    if engine.tokenizer is None:
        raise ValueError(f"model {engine.model_name!r} has no tokenizer (it takes token ids only)")
    if job.task == "detokenize":
        ids = list(job.prompt_token_ids)
        return Tokenized([], engine.tokenizer.decode(ids), engine.max_model_len)
    if job.messages is not None and chat is not None:
        ids = chat(job)
    elif job.messages is not None:
        ids = engine.encode_chat([{"role": m.role, "content": m.content} for m in job.messages],
                                 job.add_generation_prompt, job.chat_template_kwargs)
    else:
        ids = engine.tokenizer.encode(job.prompt, add_special_tokens=job.add_special_tokens)
    return Tokenized(list(ids), "", engine.max_model_len)
