"""The KV block pool: ownership, ref counts, LRU eviction of cached blocks and verified prefix-cache hits."""
from __future__ import annotations

from collections import Counter

from hypothesis import given, settings, strategies as st

from kvgate.engine.block_manager import BlockManager
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.sequence import Sequence

BS = 4


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(), max_tokens=16)


def admit(bm: BlockManager, s: Sequence, compute_all: bool = True) -> int:
    hits = bm.match_prefix(s)
    assert bm.can_allocate(hits, s.num_tokens)
    bm.allocate(s, hits, s.num_tokens)
    if compute_all:
        s.num_computed_tokens = s.num_tokens
        bm.commit(s)
    return len(hits) * BS


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    owners = Counter(b for s in live for b in s.block_table)
    free = list(bm.empty) + list(bm.evictable)
    assert len(free) == len(set(free)), "a block is twice in the free lists"
    for block in bm.blocks:
        assert block.ref_count == owners[block.block_id], f"block {block.block_id} ref count wrong"
        assert (block.ref_count == 0) == (block.block_id in free), f"block {block.block_id} leaked or doubly owned"
        if block.block_id in bm.empty:
            assert block.hash is None
    for h, block_id in bm.hash_to_block.items():
        assert bm.blocks[block_id].hash == h
    assert len(free) + len(owners) == bm.num_blocks


def test_second_sequence_with_same_prefix_hits_the_cache_and_shares_blocks():
    bm = BlockManager(16, BS)
    a, b = seq(list(range(10)), "a"), seq(list(range(8)) + [99, 98, 97], "b")
    admit(bm, a)
    assert admit(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    check_invariants(bm, [a, b])


def test_partial_block_is_never_shared():
    bm = BlockManager(16, BS)
    a, b = seq(list(range(6)), "a"), seq(list(range(6)) + [7], "b")
    admit(bm, a)
    assert admit(bm, b) == 4  # only the one full block; a's half-filled second block stays private
    assert a.block_table[1] != b.block_table[1]


def test_fully_cached_prompt_still_leaves_a_token_to_compute():
    bm = BlockManager(16, BS)
    a = seq(list(range(8)), "a")
    admit(bm, a)
    b = seq(list(range(8)), "b")
    assert admit(bm, b) == 4


def test_hash_collision_is_not_a_hit():
    bm = BlockManager(16, BS)
    a = seq([1, 2, 3, 4, 5], "a")
    admit(bm, a)
    b = seq([9, 9, 9, 9, 5], "b")
    bm.block_hash(b, 0)
    b.block_hashes[0] = a.block_hashes[0]  # force the same hash for different tokens
    assert bm.match_prefix(b) == []


def test_uncomputed_blocks_are_not_offered_to_other_sequences():
    bm = BlockManager(16, BS)
    a = seq(list(range(9)), "a")
    admit(bm, a, compute_all=False)
    assert bm.match_prefix(seq(list(range(9)), "b")) == []


def test_freed_cached_blocks_survive_until_free_blocks_run_out():
    bm = BlockManager(4, BS)
    a = seq(list(range(9)), "a")  # 3 blocks, 2 full and cached
    admit(bm, a)
    bm.free(a)
    assert bm.num_free == 4 and len(bm.evictable) == 2
    c = seq([50], "c")
    admit(bm, c)  # takes the never-cached block first
    again = seq(list(range(9)), "again")
    assert admit(bm, again) == 8
    check_invariants(bm, [c, again])


def test_eviction_takes_least_recently_used_cached_block_and_forgets_its_hash():
    bm = BlockManager(3, BS)
    a = seq(list(range(4)) + [0], "a")
    admit(bm, a)
    bm.free(a)  # a's full block is now evictable; two empty blocks left
    big = seq(list(range(100, 111)), "big")  # needs all three blocks
    admit(bm, big, compute_all=False)
    assert not bm.hash_to_block
    assert bm.match_prefix(seq(list(range(4)) + [1], "x")) == []


op = st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 2), min_size=1, max_size=14)),
    st.tuples(st.just("grow"), st.integers(0, 10), st.integers(1, 6)),
    st.tuples(st.just("free"), st.integers(0, 10)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=40))
def test_random_workloads_keep_blocks_owned_once_and_hits_on_identical_prefixes_only(ops):
    bm = BlockManager(12, BS)
    live: list[Sequence] = []
    for i, o in enumerate(ops):
        if o[0] == "add":
            s = seq(o[1], str(i))
            hits = bm.match_prefix(s)
            for j, block_id in enumerate(hits):  # a hit must hold exactly this sequence's tokens
                assert bm.blocks[block_id].token_ids == tuple(o[1][j * BS:(j + 1) * BS])
            if bm.can_allocate(hits, s.num_tokens):
                bm.allocate(s, hits, s.num_tokens)
                s.num_computed_tokens = s.num_tokens
                bm.commit(s)
                live.append(s)
        elif o[0] == "grow" and live:
            s = live[o[1] % len(live)]
            new = s.num_tokens + o[2]
            if bm.can_append(s, new):
                bm.append(s, new)
                s.token_ids += [o[2] % 3] * o[2]
                s.num_computed_tokens = new
                bm.commit(s)
        elif o[0] == "free" and live:
            bm.free(live.pop(o[1] % len(live)))
        check_invariants(bm, live)
    for s in live:
        bm.free(s)
    check_invariants(bm, [])
    assert bm.num_free == bm.num_blocks
