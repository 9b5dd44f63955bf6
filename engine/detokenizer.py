"""Batched incremental detokenization: each step's new token ids of many requests turned into text increments in
one tokenizer call, with stop strings found in the text.

The text semantics are the engine's own (see llm_engine.detokenize_increment): a short window of ids is decoded,
a window ending in an incomplete UTF-8 character waits for the next token, a stop string cuts the text where it
starts and is never emitted, and a tail that could still grow into a stop string is held back until it cannot.
A fast (Rust) tokenizer decodes the whole batch in one `decode_batch` call, which releases the GIL."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(slots=True)
class TextState:
    """One request's text so far. Offsets index `ids`, the output ids only (the prompt is never decoded)."""
    stops: list[str]
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""
    emitted: int = 0  # characters of `text` already handed out
    stopped: bool = False  # a stop string ended it: later ids are not part of the output
    incremental: bool = True  # False: nobody reads the text before the end, so it is decoded once, at the end
    skip_special: bool = True  # False (skip_special_tokens=False): special tokens stay in the text


@dataclass(slots=True)
class TextDelta:
    request_id: str
    token_ids: list[int]  # the ids this increment covers; ids after a stop string are dropped
    text: str
    finished: bool  # the last increment: the text and ids are complete
    stopped: bool = False  # finished because of a stop string (the engine must abort the request)
    output_ids: list[int] | None = None  # all output ids, on the last increment
    output_text: str | None = None  # the whole text, on the last increment


def take_increment(state: Any, prefix: str, full: str, final: bool, num_ids: int) -> str:
    """The text a window adds; advances the window unless its end is an incomplete character (U+FFFD) that the
    next token may complete. `state` is a TextState or an engine Sequence (same offset fields)."""
    if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
        return ""
    state.prefix_offset, state.read_offset = state.read_offset, num_ids
    return full[len(prefix):]


def find_stop(state: Any, stops: list[str]) -> bool:
    """Cut the text at the earliest stop string, if one appeared; the stop string itself is never emitted."""
    longest = max(map(len, stops))
    start = max(0, state.emitted - longest)
    hits = [i for i in (state.text.find(s, start) for s in stops) if i >= 0]
    if not hits:
        return False
    state.text = state.text[:max(min(hits), state.emitted)]
    return True


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that could still grow into a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def batch_decoder(tokenizer: Any) -> Callable[..., list[str]]:
    """Decode many id lists at once, exactly as `tokenizer.decode(ids, skip_special_tokens=skip)` would.
    The Rust backend's decode_batch is used where the Python wrapper adds nothing to its output."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if hasattr(backend, "decode_batch") and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda windows, skip=True: backend.decode_batch(windows, skip_special_tokens=skip)
    return lambda windows, skip=True: [tokenizer.decode(w, skip_special_tokens=skip) for w in windows]


class Detokenizer:
    """Incremental text for many requests, one batched tokenizer call per step."""

    def __init__(self, tokenizer: Any) -> None:
        self.decoder = batch_decoder(tokenizer)
        self.states: dict[str, TextState] = {}
        self.keeping = 0  # states that keep special tokens: while none do, one decode call serves every window

    def add(self, request_id: str, stops: list[str] | None = None, incremental: bool = True,
            skip_special_tokens: bool = True) -> None:
        """`incremental=False` (no streaming, no stop strings): only the first ids (for timing) and the end are
        reported, and the text is decoded once, at the end."""
        self.drop(request_id)
        self.states[request_id] = TextState(list(stops or ()), incremental=incremental or bool(stops),
                                            skip_special=skip_special_tokens)
        self.keeping += not skip_special_tokens

    def drop(self, request_id: str) -> None:
        if (st := self.states.pop(request_id, None)) is not None:
            self.keeping -= not st.skip_special

    def decode(self, windows: list[list[int]], states: list[TextState]) -> list[str]:
        """Each window's text, by its state's skip_special_tokens: one call for each setting in use."""
        if not self.keeping:
            return self.decoder(windows)
        out: list[str] = [""] * len(windows)
        for skip in (True, False):
            index = [i for i, st in enumerate(states) if st.skip_special is skip]
            if index:
                for i, text in zip(index, self.decoder([windows[i] for i in index], skip)):
                    out[i] = text
        return out

    def step(self, updates: list[tuple[str, list[int], bool]]) -> list[TextDelta]:
        """`updates`: (request id, new ids, finished) from one engine step. Ids are taken one at a time per
        request, so a stop string is found at the very token that completed it, as the engine finds it."""
        out: list[TextDelta] = []
        pending, ends = [], []
        for rid, ids, fin in updates:
            if (st := self.states.get(rid)) is None:
                continue
            if st.incremental:
                pending.append((rid, st, ids, fin))
            elif fin:
                st.ids += ids
                ends.append((rid, st, ids))
            else:
                if not st.ids:
                    out.append(TextDelta(rid, ids, "", False))
                st.ids += ids
        if ends:
            out.extend(self._end(ends))
        depth = 0
        while pending:
            out.extend(self._round([(rid, st, ids[depth:depth + 1], fin and depth >= len(ids) - 1)
                                    for rid, st, ids, fin in pending]))
            depth += 1
            pending = [p for p in pending if depth < len(p[2]) and not p[1].stopped]
        return out

    def _end(self, ends: list[tuple[str, TextState, list[int]]]) -> list[TextDelta]:
        texts = self.decode([st.ids for _, st, _ in ends], [st for _, st, _ in ends])
        for rid, _, _ in ends:
            self.drop(rid)
        return [TextDelta(rid, ids, text, True, output_ids=st.ids, output_text=text)
                for (rid, st, ids), text in zip(ends, texts)]

    def _round(self, batch: list[tuple[str, TextState, list[int], bool]]) -> list[TextDelta]:
        windows, states = [], []
        for _, st, new, _ in batch:
            st.ids += new
            windows.append(st.ids[st.prefix_offset:st.read_offset])
            windows.append(st.ids[st.prefix_offset:])
            states += (st, st)
        texts = self.decode(windows, states)
        return [self._advance(rid, st, new, final, texts[2 * i], texts[2 * i + 1])
                for i, (rid, st, new, final) in enumerate(batch)]

    def _advance(self, rid: str, st: TextState, new: list[int], final: bool, prefix: str, full: str) -> TextDelta:
        st.text += take_increment(st, prefix, full, final, len(st.ids))
        if st.stops and find_stop(st, st.stops):
            st.stopped = final = True
        end = len(st.text) if final else len(st.text) - held_back(st.text, st.stops)
        text, st.emitted = st.text[st.emitted:end], max(st.emitted, end)
        if not final:
            return TextDelta(rid, new, text, False)
        self.drop(rid)
        return TextDelta(rid, new, text, True, st.stopped, output_ids=st.ids, output_text=st.text)
