"""Decode steps as CUDA graphs: one graph per batch-size bucket, captured once, replayed every step.

Inputs live in static buffers sized for max_batch; a step of b sequences copies its inputs into
the first b rows, pads up to the bucket with rows that read and write only the scratch block,
replays, and returns the first b rows of the bucket's static logits.
"""

from __future__ import annotations

import torch

from model.mla import AttentionBatch
from runtime.kv_cache import SCRATCH_BLOCK


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, max_batch + 1, 8))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model, cache, max_batch: int, max_blocks: int):
        dev = model.device
        self.model, self.cache, self.max_batch = model, cache, max_batch
        self.sizes = bucket_sizes(max_batch)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slots = torch.full((max_batch,), SCRATCH_BLOCK * cache.page, dtype=torch.long, device=dev)
        self.block_table = torch.full((max_batch, max_blocks), SCRATCH_BLOCK, dtype=torch.int32, device=dev)
        self.seqlens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _step(self, b: int) -> torch.Tensor:
        batch = AttentionBatch(self.positions[:b], self.slots[:b], self.block_table[:b], self.seqlens[:b], decode=True)
        return self.model.forward(self.input_ids[:b], batch, self.cache.layers)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool)."""
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):
                self._step(b)                    # warm up: compile kernels, settle allocations
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    self.logits[b] = self._step(b)
                pool = g.pool() if pool is None else pool
                self.graphs[b] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def run(self, input_ids, positions, slots, block_table, seqlens) -> torch.Tensor:
        """The same tensors as an eager decode step (b rows, on the device); returns logits (b, vocab)."""
        if not self.graphs:
            self.capture()
        b = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(slots)
        self.block_table[:b].copy_(block_table)
        self.seqlens[:b].copy_(seqlens)
        if size > b:  # padding rows: scratch block only
            self.input_ids[b:size].zero_()
            self.positions[b:size].zero_()
            self.slots[b:size].fill_(SCRATCH_BLOCK * self.cache.page)
            self.block_table[b:size].fill_(SCRATCH_BLOCK)
            self.seqlens[b:size].fill_(1)
        self.graphs[size].replay()
        return self.logits[size][:b]
