"""Paged latent KV cache: one (num_blocks, 64, 1, 576) tensor per layer, blocks handed out per sequence.

Block 0 is never handed out: padded rows of a CUDA-graph batch write and read it, so they cannot
touch a live sequence's cache.
"""

from __future__ import annotations

import torch

PAGE_SIZE = 64
SCRATCH_BLOCK = 0


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    """A free list of block ids (lowest first, so runs are reproducible)."""

    def __init__(self, num_blocks: int, reserved: int = 1):
        if num_blocks <= reserved:
            raise ValueError(f"num_blocks must exceed the {reserved} reserved block(s), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, reserved - 1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} cache blocks, {len(self._free)} free of {self.num_blocks}")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        self._free.sort(reverse=True)


class PagedLatentCache:
    """The latent cache of every layer, plus its block allocator.

    layers[i] is layer i's (num_blocks, page, 1, width) view, contiguous (ops.mla_decode's layout);
    token p of a sequence with blocks B lives at slot B[p // page] * page + p % page."""

    def __init__(self, num_layers: int, num_blocks: int, width: int, dtype: torch.dtype, device, page: int = PAGE_SIZE):
        self.page, self.width, self.dtype = page, width, dtype
        self.kv = torch.zeros(num_layers, num_blocks, page, 1, width, dtype=dtype, device=device)
        self.layers = list(self.kv.unbind(0))
        self.allocator = BlockAllocator(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[1]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page)

    def slots(self, blocks: list[int], start: int, end: int) -> list[int]:
        """Cache slots of token positions [start, end) of a sequence holding `blocks`."""
        return [blocks[p // self.page] * self.page + p % self.page for p in range(start, end)]

    def block_table(self, block_lists: list[list[int]], width: int, device=None) -> torch.Tensor:
        """(len(block_lists), width) int32; unused entries point at the scratch block."""
        table = torch.full((len(block_lists), width), SCRATCH_BLOCK, dtype=torch.int32)
        for i, blocks in enumerate(block_lists):
            table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return table.to(device if device is not None else self.kv.device)

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
