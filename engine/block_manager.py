"""The KV block pool: ref-counted fixed-size blocks, a free list in LRU order, and a prefix cache of full
blocks keyed by a chained hash (hash(parent_hash, token_ids)) and verified against the token ids on a hit.

A LoRA adapter's sequence starts its chain from the adapter's seed (Sequence.lora_seed; None for the base model) and
a hit checks the seed too: the same tokens under two adapters, or under an adapter and the base model, have
different K/V, so they never share a block."""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from kvgate.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set only once the block is full and its K/V are computed
    token_ids: tuple[int, ...] = ()
    seed: int | None = None  # the chain's LoRA seed: whose K/V these are


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1: give the KV cache more memory")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.empty: deque[int] = deque(range(num_blocks))  # free and holding nothing worth keeping
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free but cached, least recently used first
        self.hash_to_block: dict[int, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.empty) + len(self.evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hash(self, seq: Sequence, index: int) -> int:
        bs = self.block_size
        while len(seq.block_hashes) <= index:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else seq.lora_seed
            seq.block_hashes.append(chain_hash(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs])))
        return seq.block_hashes[index]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding this sequence's leading full blocks; at least one token is left to compute
        so the step that admits it can sample. A sequence asking for prompt logprobs takes none: a cached block's
        K/V are there but not the logits of its positions, which it needs."""
        if not self.enable_prefix_caching or seq.prompt_logprobs is not None:
            return []
        bs, hits = self.block_size, []
        for i in range((seq.num_tokens - 1) // bs):
            block_id = self.hash_to_block.get(self.block_hash(seq, i))
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]) \
                    or self.blocks[block_id].seed != seq.lora_seed:
                break
            hits.append(block_id)
        return hits

    def held_prefix(self, token_ids: list[int], hashes: list[int], seed: int | None = None) -> int:
        """Leading full blocks of these tokens that sequences hold now (cached, ref count > 0): a new sequence
        starting with them shares those blocks instead of taking free ones. Cached blocks nobody holds are not
        counted: reviving one takes a free block. `hashes` keeps the chained hashes between calls; `seed`: the
        LoRA adapter's (Sequence.lora_seed)."""
        if not self.enable_prefix_caching:
            return 0
        bs, held = self.block_size, 0
        for i in range((len(token_ids) - 1) // bs):
            if len(hashes) <= i:
                hashes.append(chain_hash(hashes[-1] if i else seed, tuple(token_ids[i * bs:(i + 1) * bs])))
            block_id = self.hash_to_block.get(hashes[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0 or block.token_ids != tuple(token_ids[i * bs:(i + 1) * bs]) or block.seed != seed:
                break
            held += 1
        return held

    def can_allocate(self, hits: list[int], num_tokens: int) -> bool:
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.blocks_for(num_tokens) - len(hits) + revived <= self.num_free

    def allocate(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        """First blocks of a sequence: the prefix-cache hits, then fresh blocks up to `num_tokens`."""
        assert not seq.block_table, f"sequence {seq.request_id} already holds blocks"
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.evictable[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_committed_blocks = len(hits)
        self.append(seq, num_tokens)

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(seq.block_table) <= self.num_free

    def append(self, seq: Sequence, num_tokens: int) -> None:
        """Grow the block table so that `num_tokens` tokens have slots."""
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self._take())

    def commit(self, seq: Sequence) -> None:
        """Publish the sequence's newly computed full blocks in the prefix cache."""
        full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching:
            seq.num_committed_blocks = full
            return
        bs = self.block_size
        for i in range(seq.num_committed_blocks, full):
            block = self.blocks[seq.block_table[i]]
            h = self.block_hash(seq, i)
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.token_ids, block.seed = h, tuple(seq.token_ids[i * bs:(i + 1) * bs]), seq.lora_seed
                self.hash_to_block[h] = block.block_id
        seq.num_committed_blocks = max(seq.num_committed_blocks, full)

    def free(self, seq: Sequence) -> None:
        # the tail goes first into the LRU order so a shared prefix outlives the blocks that extend it
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self.empty.append(block_id)
                else:
                    self.evictable[block_id] = None
        seq.block_table.clear()
        seq.table_version += 1
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0

    def _take(self) -> int:
        if self.empty:
            block_id = self.empty.popleft()
        elif self.evictable:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids, block.seed = None, (), None
        else:
            raise RuntimeError("no free KV block: the scheduler must check can_append/can_allocate first")
        self.blocks[block_id].ref_count = 1
        return block_id
