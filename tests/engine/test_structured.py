"""Structured output in the engine (issue 25): the mask the sampler applies is exactly what the grammar allows, answers
follow their constraint at temperature 0 and 0.8, a cut-off answer ends `length`, preemption by recompute changes
nothing, and a constraint that cannot compile is an error for its request alone."""
from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.constraints import allowed_by_reference
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.sampler import Sampler
from tests.engine.helpers import vocab_source

pytest.importorskip("llguidance")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
                         "kind": {"enum": ["cat", "dog"]}}}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
COLORS = ["red", "green", "blue"]


def structured(kind: str, spec: object = "", choices=()) -> dict:
    return {"kind": kind, "spec": spec if isinstance(spec, str) else json.dumps(spec), "choices": list(choices)}


@pytest.fixture(scope="module")
def smol_tokenizer():
    from kvgate.engine.loader import resolve_model
    return resolve_model("smollm2-135m").tokenizer


@pytest.fixture(scope="module")
def tiny_with_vocab(smol_tokenizer):
    """A tiny random Llama over SmolLM2's real vocabulary, so grammars have real tokens to allow."""
    return vocab_source(smol_tokenizer)


def test_the_mask_applied_at_every_step_is_what_the_matcher_alone_accepts(tiny_with_vocab, monkeypatch):
    """Every token is tried on the matcher alone. The mask must allow exactly those, but for one rule of llguidance's
    own: where the grammar forces bytes (`{"` after nothing), a token that is a strict prefix of them (`{`) is left
    out so the forced text is tokenized canonically (`{"` is one token); such a token is accepted one at a time."""
    checked, canonical_only = [], []
    original = Sampler.mask

    def checking_mask(self, logits, seqs, rows):
        if self._filling is not None:  # the step's fill may still hold the matchers: llguidance refuses a second user
            self._filling[2].result()
        references = [set(allowed_by_reference(seqs[i].matcher, logits.shape[1])) for i in rows]
        forced = [seqs[i].matcher.compute_ff_bytes() for i in rows]
        original(self, logits, seqs, rows)
        vocab = engine.grammars.tokenizer_future().result()
        for i, reference, ff in zip(rows, references, forced):
            allowed = set(torch.isfinite(logits[i]).nonzero().flatten().tolist())
            assert not allowed - reference, f"row {i}: {sorted(allowed - reference)[:8]} allowed, the matcher refuses"
            for token in reference - allowed:
                text = vocab.decode_bytes([token])
                assert len(text) < len(ff) and ff.startswith(text), (
                    f"row {i}: token {token} ({text!r}) refused though the matcher accepts it (forced {ff!r})")
                canonical_only.append(token)
            checked.append(len(reference))

    monkeypatch.setattr(Sampler, "mask", checking_mask)
    engine = LLMEngine(tiny_with_vocab, max_num_seqs=4, kv_cache_memory=1 << 22, device="cpu")
    engine.add_request("json", "Answer:", SamplingParams(temperature=0.8, seed=3, max_tokens=6,
                                                         structured=structured("json_schema", PERSON)))
    engine.add_request("free", "Answer:", SamplingParams(temperature=0.8, seed=3, max_tokens=6))
    engine.add_request("date", "Answer:", SamplingParams(temperature=0, max_tokens=6,
                                                         structured=structured("regex", DATE)))
    while engine.has_unfinished():
        engine.step()
    assert len(checked) >= 8  # both constrained rows, at several steps (the free row is never masked)
    assert len(canonical_only) <= len(checked)  # at most a token or so a step, not a different mask
    assert min(checked) >= 1 and max(checked) < len(tiny_with_vocab.tokenizer)


@pytest.fixture(scope="module")
def smol_llm():
    torch.set_num_threads(1)
    return LLM("smollm2-135m", max_model_len=512, kv_cache_memory=1 << 26, max_num_seqs=8, device="cpu")


def ask(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": topic}]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_smollm2_answers_follow_their_schema_regex_and_choice(smol_llm, temperature):
    requests = [
        (ask("Describe a pet as JSON."), structured("json_schema", PERSON), 60),
        (ask("Give me any JSON object about Paris."), structured("json_object"), 40),
        (ask("When did it happen? Answer with a date."), structured("regex", DATE), 12),
        (ask("Pick a color."), structured("choice", choices=COLORS), 6),
    ]
    params = [SamplingParams(temperature=temperature, seed=7, max_tokens=n, structured=s) for _, s, n in requests]
    outs = smol_llm.chat([m for m, _, _ in requests], params, use_tqdm=False)
    person, anything, date, color = outs
    assert person.finish_reason == "stop", person.text
    jsonschema.validate(json.loads(person.text), PERSON)
    if anything.finish_reason == "stop":  # any JSON may run long; cut off it is only the start of one
        assert isinstance(json.loads(anything.text), dict)
    assert re.fullmatch(DATE, date.text) and date.finish_reason == "stop"
    assert color.text in COLORS and color.finish_reason == "stop"


def test_a_cut_off_structured_answer_ends_with_length(smol_llm):
    out = smol_llm.chat([ask("Describe a pet as JSON.")],
                        SamplingParams(temperature=0, max_tokens=4, structured=structured("json_schema", PERSON)),
                        use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_a_preempted_constrained_greedy_sequence_writes_what_an_unpreempted_one_does(tiny_with_vocab):
    prompts = [f"Record {i}:" for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=False,
                            structured=structured("json_schema", PERSON))

    def run(kv_bytes: int):
        engine = LLMEngine(tiny_with_vocab, max_num_seqs=6, kv_cache_memory=kv_bytes, block_size=4, device="cpu")
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params, stream_text=False)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (out.token_ids, out.finish_reason)
        return done, engine.stats.preemptions

    block = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, 4 tokens, 2 kv heads, head size 16, float32
    roomy, none = run(200 * block)
    tight, preemptions = run(24 * block)
    assert none == 0 and preemptions > 0
    assert tight == roomy


def test_a_constraint_that_does_not_compile_is_an_error_for_its_request_alone(tiny_with_vocab):
    engine = LLMEngine(tiny_with_vocab, max_num_seqs=4, kv_cache_memory=1 << 22, device="cpu")
    engine.add_request("bad", "x", SamplingParams(max_tokens=4, structured=structured("json_schema",
                                                                                      {"type": "no-such-type"})))
    engine.add_request("deep", "x", SamplingParams(max_tokens=4, structured=structured(
        "regex", "(" * 2000 + "a" + ")*" * 2000)))
    engine.add_request("good", "x", SamplingParams(temperature=0, max_tokens=4, structured=structured(
        "choice", choices=COLORS)))
    engine.add_request("free", "x", SamplingParams(temperature=0, max_tokens=4))
    done, start = {}, time.monotonic()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert time.monotonic() - start < 60  # generous: bounded, not a figure
    assert done["bad"].finish_reason == "error" and "no-such-type" in done["bad"].error
    assert done["deep"].finish_reason == "error" and done["deep"].error
    assert done["good"].finish_reason == "stop" and tiny_with_vocab.tokenizer.decode(done["good"].token_ids) in COLORS
    assert done["free"].finish_reason in ("stop", "length") and done["free"].token_ids


def test_a_compile_past_its_time_limit_is_an_error_and_a_cached_grammar_is_reused(tiny_with_vocab):
    engine = LLMEngine(tiny_with_vocab, max_num_seqs=4, kv_cache_memory=1 << 22, device="cpu",
                       grammar_compile_timeout_s=0.01)  # the vocabulary alone takes longer to prepare
    engine.add_request("slow", "x", SamplingParams(max_tokens=4, structured=structured("regex", "[a-z]+")))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finish_reason == "error" and "took more than 0.01 s to compile" in outs[-1].error
    engine.grammars.timeout_s = 60
    for i in range(3):
        engine.add_request(f"again{i}", "x", SamplingParams(max_tokens=3, structured=structured("regex", "[a-z]+")))
    while engine.has_unfinished():
        engine.step()
    assert engine.grammars.compiles == 2 and engine.grammars.hits == 2  # the timed-out one, then one for all three


def run_engine(source, params: SamplingParams, prompts: list[str], **config) -> tuple[dict, int, list]:
    """Every request to its end: (request id -> final output, engine steps taken, every step output)."""
    engine = LLMEngine(source, max_num_seqs=len(prompts), kv_cache_memory=1 << 22, device="cpu", **config)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params, stream_text=False)
    done, outputs = {}, []
    while engine.has_unfinished():
        for out in engine.step():
            outputs.append(out)
            if out.finished:
                done[out.request_id] = out
    return done, engine.steps, outputs


def test_jump_forward_appends_what_the_grammar_forces_without_a_forward_per_token(tiny_with_vocab):
    """PERSON's keys, quotes and colons are forced: with jump-forward a request takes fewer steps than tokens, and
    its answer still follows the schema; counted as output like any token."""
    params = SamplingParams(temperature=0, max_tokens=120, structured=structured("json_schema", PERSON))
    prompts = ["Record 1:", "Record 2:"]
    jumped, _, jumped_outputs = run_engine(tiny_with_vocab, params, prompts)
    stepped, _, stepped_outputs = run_engine(tiny_with_vocab, params, prompts, jump_forward=False)
    tok = tiny_with_vocab.tokenizer
    for done in (jumped, stepped):
        for out in done.values():
            assert out.finish_reason == "stop", tok.decode(out.token_ids)
            jsonschema.validate(json.loads(tok.decode(out.token_ids)), PERSON)
            assert out.output_tokens == len(out.token_ids)
    for rid in jumped:  # a step output is a forward's token; with jump-forward the four keys alone are forced
        assert sum(o.request_id == rid for o in stepped_outputs) == len(stepped[rid].token_ids)
        assert sum(o.request_id == rid for o in jumped_outputs) < len(jumped[rid].token_ids) - 4


def test_a_forced_run_stops_at_max_tokens_and_a_request_with_logprobs_never_jumps(tiny_with_vocab):
    params = SamplingParams(temperature=0, max_tokens=3, structured=structured("json_schema", PERSON))
    (cut,) = run_engine(tiny_with_vocab, params, ["Record:"])[0].values()
    assert cut.finish_reason == "length" and len(cut.token_ids) == cut.output_tokens == 3
    params = SamplingParams(temperature=0, max_tokens=120, logprobs=1, structured=structured("json_schema", PERSON))
    done, _, outputs = run_engine(tiny_with_vocab, params, ["Record:"])
    assert done["0"].finish_reason == "stop"
    assert all(len(o.new_token_ids) == len(o.logprobs) == 1 for o in outputs)  # a logprob for every token
    assert sum(len(o.new_token_ids) for o in outputs) == len(done["0"].token_ids)


def test_a_forced_ending_is_appended_whole_and_the_text_is_the_answer(tiny_with_vocab):
    """Everything after the first token is forced here; the matcher is complete once it has consumed the forced run,
    and every forced token must still reach the output (it once stopped after the first: `{"k": "company`)."""
    schema = {"type": "object", "properties": {"k": {"enum": ["company"]}}, "required": ["k"],
              "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=40, structured=structured("json_schema", schema))
    for jump in (True, False):
        done, _, outputs = run_engine(tiny_with_vocab, params, ["Kind:"], jump_forward=jump)
        out = done["0"]
        assert out.finish_reason == "stop" and json.loads(tiny_with_vocab.tokenizer.decode(out.token_ids)) == {
            "k": "company"}, (jump, tiny_with_vocab.tokenizer.decode(out.token_ids))
        if jump:  # the first token drawn, the rest forced in one go: one step output for all of them
            assert len(outputs) == 1 and outputs[0].new_token_ids == out.token_ids


# issue 45, break 3: a matcher the grammar engine put in error (its parser limits) was read as a finished grammar
ENDLESS = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}  # no finite instance
NEVER_ENDS = 'start: "x" start'  # no finite derivation


def test_a_schema_with_no_finite_instance_ends_with_an_error_naming_the_grammar_engines_message(smol_llm):
    """Before: finish_reason stop with `{"` (the matcher had stopped in error: "Too many items"). Its neighbour in
    the batch is served as ever, and its KV blocks go back as any finished sequence's."""
    free = smol_llm.engine.block_manager.num_free
    endless, color = smol_llm.chat([ask("Describe a linked list as JSON."), ask("Pick a color.")],
                                   [SamplingParams(temperature=0, max_tokens=40,
                                                   structured=structured("json_schema", ENDLESS)),
                                    SamplingParams(temperature=0, max_tokens=6,
                                                   structured=structured("choice", choices=COLORS))], use_tqdm=False)
    assert endless.finish_reason == "error", (endless.finish_reason, endless.text)
    assert "Too many items" in endless.error and "json_schema" in endless.error, endless.error
    assert "<state>" not in endless.error  # the engine's first line, not its dump of the parser
    assert color.text in COLORS and color.finish_reason == "stop"
    assert smol_llm.engine.block_manager.num_free == free and not smol_llm.engine.seqs


@pytest.mark.parametrize("jump_forward", [True, False])
def test_a_grammar_that_never_terminates_ends_with_an_error_not_stop(smol_llm, jump_forward, monkeypatch):
    """Before: finish_reason stop with `xxxx`, which the grammar does not accept as an answer."""
    monkeypatch.setattr(smol_llm.engine.config, "jump_forward", jump_forward)
    (out,) = smol_llm.generate(["Write x:"], SamplingParams(temperature=0, max_tokens=20,
                                                           structured=structured("grammar", NEVER_ENDS)),
                               use_tqdm=False)
    assert out.finish_reason == "error", (out.finish_reason, out.text)
    assert "Too many items" in out.error and "grammar" in out.error, out.error
