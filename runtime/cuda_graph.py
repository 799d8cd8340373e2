"""Decode steps as CUDA graphs: one graph per batch-size bucket, captured once, replayed every step.

Inputs live in static buffers sized for max_batch; a step of b sequences copies its inputs into
the first b rows, pads up to the bucket with rows that read and write only the scratch block,
replays, and returns a copy of the first b rows of the bucket's static logits (the static tensor
itself is overwritten by the next replay).

Capture and replay go through a recorder: CudaGraphRecorder (torch.cuda.CUDAGraph) on the GPU;
ReplayRecorder, for tests on a machine without one, records the step's callable and the tensor it
returned, and a replay calls it again and writes the result into that same tensor, so the static
buffers, bucket padding, input refresh and the model's capture-time paths run on the CPU too.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from model import kernels
from model.mla import AttentionBatch
from runtime.kv_cache import SCRATCH_BLOCK


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, max_batch + 1, 8))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


class CudaGraphRecorder:
    """torch.cuda.CUDAGraph capture on a side stream; graphs share the first graph's memory pool."""

    def __init__(self):
        self.pool = None
        self.stream = None

    @contextmanager
    def session(self):
        self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream().wait_stream(self.stream)
        torch.cuda.synchronize()

    def warmed_up(self) -> None:
        torch.cuda.synchronize()

    def capture(self, fn):
        """Record fn(); returns (graph, the tensor fn returned, rewritten by every replay)."""
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool, stream=self.stream):
            out = fn()
        if self.pool is None:
            self.pool = g.pool()
        return g, out

    def replay(self, graph) -> None:
        graph.replay()


class ReplayRecorder:
    """A stand-in for CUDA graphs on any device (tests): capture runs fn() once and keeps (fn, its
    output); replay runs fn() again on the same static buffers and copies the result into that
    output, as a graph replay rewrites its captured output in place. While fn runs the model sees
    kernels.capturing() true, so it takes its capture-time (host-sync-free) paths."""

    @contextmanager
    def session(self):
        yield

    def warmed_up(self) -> None:
        pass

    def capture(self, fn):
        with kernels.simulated_capture():
            out = fn()
        return (fn, out), out

    def replay(self, graph) -> None:
        fn, out = graph
        with kernels.simulated_capture():
            out.copy_(fn())


class DecodeGraphs:
    def __init__(self, model, cache, max_batch: int, max_blocks: int, recorder=None):
        dev = model.device
        self.model, self.cache, self.max_batch = model, cache, max_batch
        self.recorder = recorder if recorder is not None else CudaGraphRecorder()
        self.sizes = bucket_sizes(max_batch)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slots = torch.full((max_batch,), SCRATCH_BLOCK * cache.page, dtype=torch.long, device=dev)
        self.block_table = torch.full((max_batch, max_blocks), SCRATCH_BLOCK, dtype=torch.int32, device=dev)
        self.seqlens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.graphs: dict[int, object] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _step(self, b: int) -> torch.Tensor:
        batch = AttentionBatch(self.positions[:b], self.slots[:b], self.block_table[:b], self.seqlens[:b], decode=True)
        return self.model.forward(self.input_ids[:b], batch, self.cache.layers)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool)."""
        rec = self.recorder
        with rec.session():
            for b in reversed(self.sizes):
                self._step(b)                    # warm up: compile kernels, settle allocations
                rec.warmed_up()
                self.graphs[b], self.logits[b] = rec.capture(lambda b=b: self._step(b))

    def run(self, input_ids, positions, slots, block_table, seqlens) -> torch.Tensor:
        """The same tensors as an eager decode step (b rows, on the device); returns logits (b, vocab),
        a tensor of the caller's (not a view of the static logits, which the next replay overwrites)."""
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
        self.recorder.replay(self.graphs[size])
        return self.logits[size][:b].clone()
