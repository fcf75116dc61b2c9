"""The paged KV cache's bookkeeping: which block holds which tokens, and who shares it.

The cache itself (one K and one V tensor per layer, `num_blocks × page_size` slots) lives in the
runner; this file only hands out block numbers. A request reserves every block it can ever need
when it is admitted (prompt + max_new_tokens), so a running request never waits for memory and
nothing is ever preempted: the cost is admitting fewer requests when outputs end early, which the
guard's output cap keeps small.

Prefix sharing: every full block whose KV is computed is registered under a hash chained over the
blocks before it (the same block of tokens after a different prefix has different KV). A new
request walks its prompt's full blocks through that table and reuses every block that matches,
so a shared system prompt is computed once. A block whose last user left stays registered while it
sits in the free list and is revived on a match; it is forgotten only when handed out anew (least
recently freed first). The block holding a prompt's last token is never shared: that token's
logits must be computed.

Requests that arrive together (a burst behind one system prompt) would each compute the prefix: none
of its blocks is computed when they are admitted. So an admitted request's full prompt blocks are
*promised* (`pending`) until computed, and the scheduler holds back a request whose prompt starts
with a promised block until the promise is kept or its owner leaves (`awaits_shared_prefix`), then
admits it onto the computed blocks: SGLang's in-batch prefix caching, for the same reason.
"""

from __future__ import annotations

from collections import OrderedDict

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, page_size: int, prefix_sharing: bool = True) -> None:
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.prefix_sharing = prefix_sharing
        self.refs = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((block, None) for block in range(num_blocks))
        self.block_of_hash: dict[int, int] = {}
        self.key_of_block: dict[int, tuple[int, tuple[int, ...]]] = {}  # block → (hash, its tokens)
        self.shared_tokens = 0  # prompt tokens that were not computed thanks to a shared block
        self.pending: dict[int, Sequence] = {}  # chain hash → the admitted request that will compute that block

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def allocate(self, seq: Sequence) -> bool:
        """Give the request every block it can need, reusing shared prefix blocks; False if they don't fit."""
        matched = self._shared_prefix(seq)
        fresh = self.blocks_for(seq.reserved_tokens) - len(matched)
        revived = sum(1 for block in matched if self.refs[block] == 0)
        if fresh > len(self.free) - revived:
            return False
        for block in matched:
            if self.refs[block] == 0:
                del self.free[block]
            self.refs[block] += 1
        seq.block_table = matched + [self._take_free_block() for _ in range(fresh)]
        seq.computed = len(matched) * self.page_size
        seq.hashed_blocks = len(matched)
        self.shared_tokens += seq.computed
        self._promise(seq)
        return True

    def release(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None
        seq.block_table = []
        self._forget_promises(seq)

    def awaits_shared_prefix(self, seq: Sequence) -> bool:
        """Whether the request's prompt continues into a block another admitted request is about to
        compute: admitting it later shares that block instead of computing it twice."""
        if not self.pending:
            return False
        for chain in self._shareable_chains(seq):
            if chain in self.pending:
                return True
            if chain not in self.block_of_hash:
                return False
        return False

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Make the request's newly completed prompt blocks findable by later requests."""
        if not self.prefix_sharing:
            return
        full = min(seq.computed, len(seq.prompt)) // self.page_size
        chains = self._prompt_chains(seq)
        while seq.hashed_blocks < full:
            index = seq.hashed_blocks
            tokens = tuple(seq.prompt[index * self.page_size : (index + 1) * self.page_size])
            chain = chains[index]
            block = seq.block_table[index]
            if chain not in self.block_of_hash:
                self.block_of_hash[chain] = block
                self.key_of_block[block] = (chain, tokens)
            if self.pending.get(chain) is seq:
                del self.pending[chain]
            seq.hashed_blocks = index + 1
        if full == len(seq.prompt) // self.page_size:
            self._forget_promises(seq)  # its prompt is computed: whatever it promised is kept or moot

    def _promise(self, seq: Sequence) -> None:
        """Mark the request's shareable prompt blocks that nobody has computed as about to be."""
        if not self.prefix_sharing:
            return
        for chain in self._shareable_chains(seq)[seq.hashed_blocks :]:
            if chain not in self.block_of_hash:
                self.pending.setdefault(chain, seq)

    def _forget_promises(self, seq: Sequence) -> None:
        if self.pending:
            for chain in self._shareable_chains(seq):
                if self.pending.get(chain) is seq:
                    del self.pending[chain]

    def _prompt_chains(self, seq: Sequence) -> list[int]:
        """The hash chain after each full prompt block (computed once per request): the same block of
        tokens after a different prefix holds different KV, so each hash covers the blocks before it."""
        if seq.prompt_chains is None:
            chains, chain = [], None
            for index in range(len(seq.prompt) // self.page_size):
                chain = hash((chain, tuple(seq.prompt[index * self.page_size : (index + 1) * self.page_size])))
                chains.append(chain)
            seq.prompt_chains = chains
        return seq.prompt_chains

    def _shareable_chains(self, seq: Sequence) -> list[int]:
        """The chains of the blocks another request may share: never the block of the last prompt token."""
        return self._prompt_chains(seq)[: (len(seq.prompt) - 1) // self.page_size]

    def _shared_prefix(self, seq: Sequence) -> list[int]:
        """The computed blocks that hold the request's leading shareable prompt blocks."""
        matched: list[int] = []
        if not self.prefix_sharing:
            return matched
        prompt = seq.prompt
        for index, candidate in enumerate(self._shareable_chains(seq)):
            tokens = tuple(prompt[index * self.page_size : (index + 1) * self.page_size])
            block = self.block_of_hash.get(candidate)
            if block is None or self.key_of_block.get(block) != (candidate, tokens):
                break
            matched.append(block)
        return matched

    def _take_free_block(self) -> int:
        block, _ = self.free.popitem(last=False)
        key = self.key_of_block.pop(block, None)
        if key is not None and self.block_of_hash.get(key[0]) == block:
            del self.block_of_hash[key[0]]
        self.refs[block] = 1
        return block
