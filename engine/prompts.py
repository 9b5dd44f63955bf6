"""A request's prompt as checked token ids: text through the model's tokenizer, chat messages through its chat
template, a fill-in-the-middle prompt with its FIM tokens (engine/fim.py), and every prompt's ids checked against the
vocabulary and max_model_len. The engine's front, as vLLM's input processor is: it reads the model's facts only, so
a bad prompt is refused (RequestRejected, naming the problem) before the engine holds anything for it."""
from __future__ import annotations

from typing import Any

from kvgate.engine.fim import FimFormat, fim_format, known_formats
from kvgate.engine.outputs import RequestRejected


class Prompts:
    def __init__(self, model_name: str, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.model_name, self.tokenizer, self.vocab_size, self.max_model_len = \
            model_name, tokenizer, vocab_size, max_model_len
        self.fim: FimFormat | None = fim_format(tokenizer)  # found once: the tokenizer does not change

    def ids(self, prompt: str | list[int]) -> list[int]:
        """A prompt's ids, checked against the vocabulary and max_model_len."""
        token_ids = self._tokenize(prompt)
        n = len(token_ids)
        if n > self.max_model_len:
            raise RequestRejected(f"prompt of {n} tokens is longer than max_model_len={self.max_model_len}: "
                                  "shorten it or raise max_model_len")
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRejected(f"prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        return list(token_ids)

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected(f"model {self.model_name!r} has no tokenizer: send token ids, not text")
            if not prompt:
                raise RequestRejected("prompt is empty: send at least one token")
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise RequestRejected("prompt is empty: send at least one token")
            return list(prompt)
        raise RequestRejected(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
             template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The messages through the model's chat template; `template_kwargs`: more variables the template reads
        (the wire bounds them and keeps apply_chat_template's own parameters out); `tools`: OpenAI's function tools,
        as the chat template renders them (one that knows none ignores them)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RequestRejected(f"model {self.model_name!r} has no chat template: send a plain prompt")
        try:
            with_tools = {"tools": tools} if tools else {}  # the call without tools is what it always was
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **(template_kwargs or {}), **with_tools)
        except Exception as e:  # template errors come in many types
            raise RequestRejected(f"chat messages do not fit the chat template: {e}") from e
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def fill_in_middle(self, prompt: str, suffix: str) -> list[int]:
        """A fill-in-the-middle prompt: the text before the hole and after it, with the model's FIM tokens, for the
        model to write the middle."""
        if self.fim is None:
            raise RequestRejected(f"suffix: model {self.model_name!r} has no fill-in-the-middle tokens in its "
                                  f"tokenizer (recognised: {known_formats()}); send the prompt alone, or send "
                                  "suffix to a model with FIM tokens")
        return self.fim.render(list(self.tokenizer.encode(prompt, add_special_tokens=False)),
                               list(self.tokenizer.encode(suffix, add_special_tokens=False)))
