"""Routing keys and lane ownership (producer/lanes.py): pure functions every producer and worker must agree on."""
from __future__ import annotations

import random

from kvgate.producer.lanes import (ROUTING_CHARS, ROUTING_TOKENS, decode_members, encode_member, lane_of, owned,
                                   owners, parse_lanes, read_order, routing_key)
from kvgate.producer.keys import Keys
from kvgate.producer.protocol import Message
from kvgate.producer.submission import prepare

SYSTEM = "You are a careful assistant for ACME's billing team. " * 20  # ~1,000 characters


def test_explicit_prefix_key_wins_over_the_prompt():
    a = routing_key(prompt=SYSTEM + "question one", prefix_key="tenant-7")
    b = routing_key(prompt="something else entirely", prefix_key="tenant-7")
    assert a == b != routing_key(prompt=SYSTEM + "question one")


def test_prompts_sharing_the_leading_window_share_a_key_and_differ_beyond_it_only_inside():
    assert routing_key(prompt=SYSTEM + "Why was I charged twice?") == routing_key(prompt=SYSTEM + "Cancel my plan.")
    assert routing_key(prompt="x" * (ROUTING_CHARS - 1) + "a") != routing_key(prompt="x" * (ROUTING_CHARS - 1) + "b")


def test_chat_turns_of_one_conversation_share_a_key():
    first = [Message("system", SYSTEM), Message("user", "hi")]
    later = [*first, Message("assistant", "hello!"), Message("user", "and now?")]
    assert routing_key(messages=first) == routing_key(messages=later)
    assert routing_key(messages=[Message("user", SYSTEM)]) != routing_key(messages=[Message("system", SYSTEM)])


def test_token_prompts_route_by_their_leading_token_ids():
    prefix = list(range(1000, 1000 + ROUTING_TOKENS))
    assert routing_key(prompt_token_ids=prefix + [1, 2]) == routing_key(prompt_token_ids=prefix + [3])
    assert routing_key(prompt_token_ids=[7] + prefix) != routing_key(prompt_token_ids=prefix)


def test_lane_of_is_stable_and_spreads_keys():
    assert lane_of("p:abc", 64) == lane_of("p:abc", 64)  # no salted hash(): every process agrees
    lanes = {lane_of(f"k:{i}", 64) for i in range(2000)}
    assert len(lanes) == 64


def test_a_join_or_leave_moves_about_one_nth_of_the_lanes():
    members = {f"w{i}": 1.0 for i in range(16)}
    before = owners(members, 1024)
    joined = owners({**members, "w16": 1.0}, 1024)
    moved = sum(a != b for a, b in zip(before, joined))
    assert all(b == "w16" for a, b in zip(before, joined) if a != b)  # only to the newcomer
    assert 1024 / 17 * 0.6 < moved < 1024 / 17 * 1.4
    left = owners({m: w for m, w in members.items() if m != "w3"}, 1024)
    assert [a for a, b in zip(before, left) if a != b] == ["w3"] * before.count("w3")  # only the leaver's


def test_ownership_follows_weight():
    counts = {m: 0 for m in ("big", "small")}
    for owner in owners({"big": 8.0, "small": 1.0}, 900):
        counts[owner] += 1
    assert 700 < counts["big"] < 900 and counts["small"] > 40


def test_every_lane_has_exactly_one_owner():
    members = {f"w{i}": random.Random(i).uniform(1, 10) for i in range(7)}
    mine = [owned(members, m, 64) for m in members]
    assert sorted(lane for lanes in mine for lane in lanes) == list(range(64))


def test_read_order_puts_own_lanes_first_then_all_others():
    assert read_order([5, 2], 6) == [2, 5, 0, 1, 3, 4]


def test_ring_members_round_trip_and_garbage_is_skipped():
    raw = [encode_member("gpu-a|1", 2048).encode(), b"nonsense", b"-1|w", b"nan|w", b"3|"]
    assert decode_members(raw) == {"gpu-a|1": 2048.0}


def test_stored_lane_count_parses_or_means_none():
    assert [parse_lanes(v) for v in (None, b"64", "0", b"abc", b"100000", b"\xff")] == [0, 64, 0, 0, 0, 0]


def test_submit_routes_to_the_shared_stream_without_lanes_and_to_the_key_lane_with_them():
    keys = Keys("t")
    args = dict(prompt=SYSTEM + "q1", prefix_key=None)
    assert prepare(args, keys, "c" * 16).stream == "t:jobs:default:normal"
    lane = lane_of(routing_key(prompt=SYSTEM), 8)
    assert prepare(args, keys, "c" * 16, lanes=8).stream == f"t:jobs:default:normal:{lane}"
    keyed = prepare(dict(prompt="x", prefix_key="sess-1", priority="high"), keys, "c" * 16, lanes=8)
    assert keyed.stream == f"t:jobs:default:high:{lane_of('k:sess-1', 8)}"


def test_lanes_are_a_dimension_of_each_models_streams():
    keys = Keys("t")
    keyed = prepare(dict(prompt="x", prefix_key="sess-1", model="org/m"), keys, "c" * 16, lanes=8)
    assert (keyed.stream, keyed.model) == (f"t:jobs:org/m:normal:{lane_of('k:sess-1', 8)}", "org/m")
    assert keys.job_streams("org/m", "low", 2) == ["t:jobs:org/m:low", "t:jobs:org/m:low:0", "t:jobs:org/m:low:1"]
    assert keys.all_jobs("m", 1) == ["t:jobs:m:high", "t:jobs:m:high:0", "t:jobs:m:normal", "t:jobs:m:normal:0",
                                     "t:jobs:m:low", "t:jobs:m:low:0"]
    assert keys.all_jobs(None) == keys.served_jobs(["default"]) == ["t:jobs:default:high", "t:jobs:default:normal",
                                                                    "t:jobs:default:low"]
    assert keys.lanes() == "t:lanes"  # one count for every model
    assert (keys.lane_ring("org/m"), keys.lane_ring(None)) == ("t:lanes:ring:org/m", "t:lanes:ring:default")
