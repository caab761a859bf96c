"""Reference paged-KV block manager.

The prefix cache is keyed by the exact token prefix (a tuple of every token up to the end of the
block), so there is nothing to verify and no collision is possible. Rules (the same as the C++):
- a full computed block is registered when its position's key is not cached yet and the block
  before it in the same table is cached (or it is block 0);
- free blocks: uncached ones are used first; otherwise the least recently freed cached block is
  evicted, together with every cached block whose key extends its key;
- a table is freed last block first;
- the next write into a block shared by several tables copies it first (copy-on-write).
"""

from __future__ import annotations


class RefBlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, prefix_caching: bool, watermark_blocks: int
    ):
        self.num_blocks = num_blocks
        self.bs = block_size
        self.prefix_caching = prefix_caching
        self.watermark_blocks = watermark_blocks
        self.ref = [0] * num_blocks
        self.free_uncached = list(range(num_blocks))
        self.lru: list[int] = []  # cached free blocks, least recently freed first
        self.cache: dict[tuple, int] = {}  # token prefix -> block
        self.key_of: dict[int, tuple] = {}  # cached block -> its prefix
        self.copies = 0
        self.queries = 0
        self.hits = 0

    # -- counts
    def num_free(self) -> int:
        return len(self.free_uncached) + len(self.lru)

    def blocks_for(self, slots: int) -> int:
        return -(-slots // self.bs)

    # -- allocation
    def _uncache(self, block: int) -> None:
        key = self.key_of[block]
        for b, k in list(self.key_of.items()):
            if k[: len(key)] == key:
                del self.cache[k]
                del self.key_of[b]
                if b in self.lru:
                    self.lru.remove(b)
                    self.free_uncached.append(b)

    def alloc(self) -> int:
        if not self.free_uncached:
            self._uncache(self.lru[0])
        b = self.free_uncached.pop()
        assert self.ref[b] == 0
        self.ref[b] = 1
        return b

    def release(self, b: int) -> None:
        self.ref[b] -= 1
        assert self.ref[b] >= 0
        if self.ref[b] == 0:
            (self.lru if b in self.key_of else self.free_uncached).append(b)

    def free_table(self, table: list[int]) -> None:
        for b in reversed(table):
            self.release(b)
        table.clear()

    def needed(self, table: list[int], written: int, slots: int) -> int:
        need = max(0, self.blocks_for(slots) - len(table))
        idx = written // self.bs
        if slots > written and idx < len(table) and self.ref[table[idx]] > 1:
            need += 1
        return need

    def ensure_slots(self, table: list[int], written: int, slots: int) -> bool:
        need = self.needed(table, written, slots)
        if need > self.num_free():
            return False
        idx = written // self.bs
        if slots > written and idx < len(table) and self.ref[table[idx]] > 1:
            old, new = table[idx], self.alloc()
            if written % self.bs:
                self.copies += 1
            self.release(old)
            table[idx] = new
        while len(table) < self.blocks_for(slots):
            table.append(self.alloc())
        return True

    def fork_table(self, src: list[int], written: int) -> list[int]:
        full = written // self.bs
        dst = list(src[:full])
        for b in dst:
            self.ref[b] += 1
        if written % self.bs:
            if self.num_free() > 0:
                dst.append(self.alloc())
                self.copies += 1
            else:
                self.ref[src[full]] += 1
                dst.append(src[full])
        return dst

    # -- prefix cache
    def match(self, tokens: list[int], max_blocks: int) -> list[int]:
        out = []
        if not self.prefix_caching:
            return out
        for i in range(max_blocks):
            b = self.cache.get(tuple(tokens[: (i + 1) * self.bs]))
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, blocks: list[int], table: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self.lru.remove(b)
            self.ref[b] += 1
            table.append(b)

    def register(self, table: list[int], tokens: list[int], first: int, last: int) -> int:
        if not self.prefix_caching:
            return last
        for i in range(first, last):
            b = table[i]
            if b in self.key_of:
                continue
            if i > 0 and table[i - 1] not in self.key_of:
                continue
            key = tuple(tokens[: (i + 1) * self.bs])
            if key in self.cache:
                continue
            self.cache[key] = b
            self.key_of[b] = key
        return last

    def reset(self) -> None:
        for b in list(self.key_of):
            if b in self.key_of:
                self._uncache(b)
