"""Every sampling field is declared once, in the wire's `Sampling`; the SDK's submit arguments, the wire check a worker
runs, the gateway's body fields and the engine's own SamplingParams agree with it on names, defaults and bounds.
Probe values are read from the declaration itself (each bound, and a step past it), so a new field is covered the
moment it is declared."""
from __future__ import annotations

import dataclasses
import inspect
import math

import msgspec
import pytest

from kvgate.engine.constraints import KINDS
from kvgate.engine.sampling_params import SamplingParams
from kvgate.gateway.errors import ApiError
from kvgate.gateway.settings import GatewaySettings
from kvgate.gateway.chat.plan import DIRECT, plan
from kvgate.producer import AsyncClient, Client, InvalidRequest
from kvgate.producer.constraints import STRUCTURED_KINDS, Structured
from kvgate.producer.fields import Entries, Items, Range
from kvgate.producer.protocol import SAMPLING_FIELDS, ProtocolError, Sampling, validate_sampling
from kvgate.producer.request import SubmitRequest, validate_request

NAMES = [spec.name for spec in SAMPLING_FIELDS]
# The engine is vLLM's API on its own: its max_tokens default is vLLM's 16, and the wire's upper bounds (which keep
# one queued job from costing a worker) do not bind a local caller. engine/sampling_params.py says why.
ENGINE_DEFAULTS = {"max_tokens": 16}
ENGINE_HAS_NO_UPPER_BOUND = {"max_tokens", "temperature", "seed", "stop", "stop_token_ids", "min_tokens",
                            "logit_bias"}


def probes(spec) -> list[tuple[object, bool, bool]]:
    """(value, whether the declaration allows it, whether it lies past an upper bound): each bound, a step inside
    and a step past it, read from the declaration."""
    b = spec.bounds
    if isinstance(b, Items):
        good, bad = ("x", "") if b.chars else (0, -1)
        return [([], True, False), ([good] * b.max_items, True, False), ([good] * (b.max_items + 1), False, True),
                ([bad], False, False)]
    if isinstance(b, Entries):  # each bound of a key and of a value, and one entry too many
        full = {k: b.value.le for k in range(b.max_items)}
        return [({}, True, False), ({0: b.value.ge, 7: b.value.le}, True, False), (full, True, False),
                ({**full, b.max_items: 0.0}, False, True), ({0: b.value.le + 0.5}, False, False),
                ({0: b.value.ge - 0.5}, False, False), ({b.key.ge - 1: 0.0}, False, False)]
    if not isinstance(b, Range):
        return [(spec.default, True, False)]
    step = 1 if spec.type in (int, int | None) else 1e-3
    out = [(spec.default, True, False)]
    for edge, closed, lower in ((b.ge, True, True), (b.gt, False, True), (b.le, True, False), (b.lt, False, False)):
        if edge is None:
            continue
        inward = step if lower else -step
        out.append((edge if closed else edge + inward, True, False))
        out.append((edge - inward if closed else edge, False, not lower))
    if step != 1:
        out += [(math.nan, False, False), (math.inf, False, True)]
    if b.off is not None:
        out.append((b.off, True, False))
    return out


def wire_allows(name: str, value: object) -> bool:
    try:
        validate_sampling(Sampling(**{name: value}))
    except ProtocolError:
        return False
    return True


def sdk_allows(name: str, value: object) -> bool:
    try:
        validate_request({"prompt": "x", name: value})
    except InvalidRequest:
        return False
    return True


def gateway_allows(name: str, value: object) -> bool:
    try:
        plan("completion", {"model": "m", "prompt": "x", name: value}, GatewaySettings())
    except ApiError:
        return False
    return True


def engine_allows(name: str, value: object) -> bool:
    try:
        SamplingParams(**{name: value})
    except ValueError:
        return False
    return True


CASES = [(spec.name, value, ok, upper) for spec in SAMPLING_FIELDS for value, ok, upper in probes(spec)]


def test_every_sampling_field_has_its_bounds_declared_or_is_a_flag():
    for spec in SAMPLING_FIELDS:
        assert spec.bounds is not None or spec.type is bool, f"{spec.name} is declared without bounds"


@pytest.mark.parametrize("name,value,ok,upper", CASES, ids=[f"{n}={v!r:.20}" for n, v, *_ in CASES])
def test_sdk_wire_gateway_and_engine_agree_on_each_bound(name, value, ok, upper):
    assert wire_allows(name, value) is ok
    assert sdk_allows(name, value) is ok
    if name in DIRECT or name == "max_tokens":
        assert gateway_allows(name, value) is ok
    if upper and name in ENGINE_HAS_NO_UPPER_BOUND:
        assert engine_allows(name, value)
    else:
        assert engine_allows(name, value) is ok


def test_sdk_wire_and_engine_share_names_and_defaults():
    engine = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
              for f in dataclasses.fields(SamplingParams) if f.name != "extra"}
    assert sorted(engine) == sorted(NAMES)
    wire = {spec.name: spec.default for spec in SAMPLING_FIELDS}
    lists = {spec.name for spec in SAMPLING_FIELDS if isinstance(spec.bounds, Items)}  # the engine's None is []
    assert {n: ENGINE_DEFAULTS.get(n, wire[n]) for n in NAMES} == {n: engine[n] or [] if n in lists else engine[n]
                                                                   for n in NAMES}
    assert SubmitRequest(prompt="x").sampling() == Sampling()  # what a submit sends when it names no field
    for client in (Client, AsyncClient):
        signature = inspect.signature(client.submit).parameters
        for spec in SAMPLING_FIELDS:  # a list the SDK takes as None, meaning the wire's empty list
            assert signature[spec.name].default == (None if isinstance(spec.bounds, (Items, Entries)) else spec.default)


def test_the_wire_and_the_engine_take_the_same_kinds_of_structured_constraint():
    """Declared twice, as the layers require (neither may import the other): the engine's list is held to the wire's,
    and the wire's list is the type its decoder checks."""
    assert KINDS == STRUCTURED_KINDS
    for kind in STRUCTURED_KINDS:
        assert msgspec.convert({"kind": kind}, Structured).kind == kind
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value 'xml'"):
        msgspec.convert({"kind": "xml"}, Structured)


def test_the_gateway_takes_every_sampling_field_and_leaves_unnamed_ones_to_the_wire_default():
    honoured = set(DIRECT) | {"max_tokens", "logprobs", "prompt_logprobs"}  # the last: completions' echo
    assert set(NAMES) <= honoured
    args = plan("completion", {"model": "m", "prompt": "x"}, GatewaySettings(default_max_tokens=99)).submits[0]
    assert args["max_tokens"] == 99  # an operator's setting, --default-max-tokens (512 unless set)
    assert not set(args) & (set(NAMES) - {"max_tokens"})


def test_kvgate_submit_has_a_flag_for_every_sampling_field_with_the_wire_default():
    import argparse

    from kvgate.commands.submit import COMMAND_DEFAULTS, add_arguments, request_from

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["hi"])
    for spec in SAMPLING_FIELDS:
        expected = COMMAND_DEFAULTS.get(spec.name, None if isinstance(spec.default, (list, dict)) else spec.default)
        assert getattr(args, spec.name) == expected, spec.name
    request = request_from(parser.parse_args(["hi", "--stop", "a", "--stop", "b", "--stop-token-ids", "7",
                                              "--ignore-eos", "--seed", "3", "--top-k", "5", "--logit-bias",
                                              '{"198": -100}', "--no-skip-special-tokens"]))
    assert (request["stop"], request["stop_token_ids"], request["ignore_eos"]) == (["a", "b"], [7], True)
    assert (request["logit_bias"], request["skip_special_tokens"]) == ({198: -100.0}, False)
    assert (request["seed"], request["top_k"], request["temperature"]) == (3, 5, 0.7)
    SubmitRequest(**request)  # what the command sends is a valid request as the SDK checks it
