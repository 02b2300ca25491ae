"""Fixed-size KV blocks: reference-counted, and shared between sequences through the prefix cache.

Prefix caching (as vLLM and nano-vllm do it). Once a full prompt block's KV is final, the block
becomes findable under a key that chains the previous block's key with this block's tokens, so a
key names the block's whole prefix. A sequence admitted later whose tokens start the same way
takes those blocks (reference count + 1) and computes only the rest. A block no sequence uses
any more keeps its key in an LRU of free-but-cached blocks; it is evicted (its key dropped) only
when a fresh block is needed and no plain free block is left. Cached blocks count as free.

Shared blocks are never written: a hit covers whole blocks only, so the target's recompute (and
the draft's first pass, which writes exactly the rows the target computes) starts on a block
boundary, inside the sequence's own blocks. A hit always leaves the last token to compute: the
target must produce its logits (the first sampled token) and, with a draft, its aux hidden
state. So a prompt of exactly n blocks reuses at most n - 1 of them; its last block is
recomputed into a fresh one rather than rewritten in place.

With an EAGLE3 draft (`lookahead=1`) a block's key also covers the token after the block. The
draft's KV at position p is built from the target's aux hidden state at p *and the token at p+1*
(spec_decode/proposer.py), so the draft KV of a block's last slot depends on the first token of
the next block: a sequence that shares a block's tokens but continues differently must not
reuse it, or its draft would attend to another request's token there; acceptance would drop
while outputs stay correct. vLLM instead drops the last matched block of every hit; the longer
key recomputes a block only when its draft KV really differs. A block becomes findable after
the step that computed its last position, which is the step whose draft first pass wrote its
draft KV with that next token (a prompt token, so known): both KVs are then final. Only blocks
whose key tokens are all prompt tokens are cached; generated tokens are not.

Keys are SHA-256 digests of (previous key, the block's token ids as int64). Python's hash of a
tuple would be stable too (PYTHONHASHSEED salts only str and bytes) but is 64 bits and not
collision-resistant: two prompts crafted to collide would read each other's KV (vLLM's
CVE-2025-25183). SHA-256 costs about a microsecond per block.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from atom_like.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, lookahead: int = 0):
        """`lookahead`: tokens after a block that its KV depends on (1 with an EAGLE3 draft)."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching, self.lookahead = enable_prefix_caching, lookahead
        self.free_blocks: deque[int] = deque(range(num_blocks))  # free and findable by no key
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free but cached, least recently used first
        self.ref_counts = [0] * num_blocks
        self.key_of: dict[int, bytes] = {}  # cached block -> its key
        self.block_of: dict[bytes, int] = {}  # key -> cached block
        # prefix-cache hit rate, in tokens: all tokens of admitted sequences, and those found cached
        self.num_query_tokens = self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ allocation

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a waiting `seq` can start from: the longest run of its leading full
        blocks found by key, ending before its last token (see the module docstring)."""
        if not self.enable_prefix_caching:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        if seq.params.prompt_logprobs is not None:
            # Prompt logprobs come from this sequence's own forward over each position: reuse only
            # what it already scored before a preemption (vLLM skips the lookup for such requests).
            limit = min(limit, len(seq.prompt_logprobs) // self.block_size)
        blocks = []
        for key in self._keys(seq, limit):
            block = self.block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate(self, seq: Sequence, prefix: list[int], num_tokens: int) -> bool:
        """Give a waiting `seq` the cached `prefix` blocks, then fresh ones up to `num_tokens`
        token slots. All or nothing: returns False, changing nothing, when the pool is too short."""
        if seq.block_table:
            raise RuntimeError(f"{seq.request_id} is admitted while holding blocks {seq.block_table}")
        fresh = max(0, self.blocks_for(num_tokens) - len(prefix))
        revived = sum(self.ref_counts[b] == 0 for b in prefix)  # cached-free blocks this hit takes back
        if fresh > self.num_free_blocks - revived:
            return False
        for block in prefix:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
        seq.block_table = list(prefix) + [self._take_free() for _ in range(fresh)]
        seq.num_cached_tokens = len(prefix) * self.block_size
        if self.enable_prefix_caching:
            self.num_query_tokens += seq.num_tokens
            self.num_hit_tokens += seq.num_cached_tokens
        return True

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s block table to hold `num_tokens` token slots. All or nothing: returns
        False, allocating nothing, when the pool is too short."""
        needed = self.blocks_for(num_tokens) - len(seq.block_table)
        if needed <= 0:  # most decode steps: the table already holds them
            return True
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free())
        return True

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks nobody holds return to the pool, cached ones as the most
        recently used. The table's tail goes first, so a prefix outlives its continuations."""
        for block in reversed(seq.block_table):
            if self.ref_counts[block] < 1:
                raise RuntimeError(f"block {block} of {seq.request_id} is freed but nobody holds it")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if block in self.key_of:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)
        seq.block_table = []

    def _take_free(self) -> int:
        """A free block for new KV: a plain free one, else the least recently used cached one."""
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.block_of[self.key_of.pop(block)]
        self.ref_counts[block] = 1
        return block

    # ------------------------------------------------------------------ caching

    def cache_computed_blocks(self, seq: Sequence, computed_before: int) -> None:
        """Make findable the full prompt blocks of `seq` that the step which took its computed
        tokens from `computed_before` to `seq.num_computed_tokens` completed (target and draft
        KV both written by it). A block another sequence already cached stays private."""
        if not self.enable_prefix_caching:
            return
        end = min(seq.num_computed_tokens, seq.num_prompt_tokens - self.lookahead) // self.block_size
        start = computed_before // self.block_size
        if start >= end:
            return
        keys = self._keys(seq, end)
        for b in range(start, end):
            block, key = seq.block_table[b], keys[b]
            if block not in self.key_of and key not in self.block_of:
                self.key_of[block], self.block_of[key] = key, block

    def _keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Keys of `seq`'s first `num_blocks` blocks (extending the ones it carries: tokens before
        its end never change while it lives)."""
        keys, size = seq.block_keys, self.block_size
        while len(keys) < num_blocks:
            b = len(keys)
            tokens = array("q", seq.token_ids[b * size:(b + 1) * size + self.lookahead])
            keys.append(hashlib.sha256((keys[-1] if keys else b"") + tokens.tobytes()).digest())
        return keys[:num_blocks]
