"""Decode steps as CUDA graphs: one graph per batch-size bucket, captured once, replayed every step.

Inputs live in static buffers sized for max_batch; a step of b sequences copies its inputs into
the first b rows, pads up to the bucket with rows that read and write only the scratch block,
replays, and returns a copy of the first b rows of the bucket's static logits (the static tensor
itself is overwritten by the next replay).

Each graph also ends with the greedy choice and the next step's inputs, computed on the device:
next_ids = argmax(logits), and for the real rows (active = 1) ids = next_ids, positions + 1,
lengths + 1; the cache slot of each row is computed inside the graph from its block table and
position. So consecutive greedy steps of the same batch (run_greedy) copy nothing to the device
and read back only the b token ids; a step that does not continue the last one (new batch, other
sampling, run()) rewrites the inputs from the host first.

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
        self.active = torch.zeros(max_batch, dtype=torch.long, device=dev)     # 1: a real row, 0: padding
        self.next_ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.block_table = torch.full((max_batch, max_blocks), SCRATCH_BLOCK, dtype=torch.int32, device=dev)
        self.seqlens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.graphs: dict[int, object] = {}
        self._expect = None          # the key of the step the graph inputs are advanced to, or None
        self._size = None
        self.writes = 0              # host writes of the inputs (steps that did not continue the last)
        self.logits: dict[int, torch.Tensor] = {}

    def _step(self, b: int) -> torch.Tensor:
        page, pos, table = self.cache.page, self.positions[:b], self.block_table[:b]
        slots = table.gather(1, (pos // page)[:, None]).squeeze(1).long() * page + pos % page
        batch = AttentionBatch(pos, slots, table, self.seqlens[:b], decode=True)
        logits = self.model.forward(self.input_ids[:b], batch, self.cache.layers)
        # the greedy choice and the next step's inputs (padding rows keep theirs: scratch block only)
        nxt, act = torch.argmax(logits, dim=-1), self.active[:b]
        self.next_ids[:b].copy_(nxt)
        self.input_ids[:b].copy_(torch.where(act.bool(), nxt, self.input_ids[:b]))
        self.positions[:b].add_(act)
        self.seqlens[:b].add_(act.to(torch.int32))
        return logits

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool)."""
        rec = self.recorder
        with rec.session():
            for b in reversed(self.sizes):
                self._step(b)                    # warm up: compile kernels, settle allocations
                rec.warmed_up()
                self.graphs[b], self.logits[b] = rec.capture(lambda b=b: self._step(b))

    def _write(self, input_ids, positions, block_table, seqlens) -> int:
        """Copy a step's inputs into the static buffers, pad to the bucket; returns the bucket size.
        (No slots: the graph computes each row's block_table[pos // page] * page + pos % page.)"""
        if not self.graphs:
            self.capture()
        b = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= b)
        self.writes += 1
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.block_table[:b].copy_(block_table)
        self.seqlens[:b].copy_(seqlens)
        self.active[:b].fill_(1)
        if size > b:  # padding rows: scratch block only
            self.input_ids[b:size].zero_()
            self.positions[b:size].zero_()
            self.block_table[b:size].fill_(SCRATCH_BLOCK)
            self.seqlens[b:size].fill_(1)
            self.active[b:size].zero_()
        return size

    def run(self, input_ids, positions, block_table, seqlens) -> torch.Tensor:
        """An eager decode step's tensors (b rows, on the device; the cache slots follow from
        block_table and positions); returns logits (b, vocab), a tensor of the caller's (not a view
        of the static logits, which the next replay overwrites)."""
        b = input_ids.shape[0]
        size = self._write(input_ids, positions, block_table, seqlens)
        self._expect = None
        self.recorder.replay(self.graphs[size])
        return self.logits[size][:b].clone()

    def run_greedy(self, key, inputs) -> list[int]:
        """A greedy step; returns the b next token ids. key identifies the step (batch, positions):
        when it is the step that follows the last replay, the graph's own advanced inputs are used
        as they are; otherwise inputs() gives (ids, positions, block_table, seqlens) to write."""
        if key != self._expect:
            self._size = self._write(*inputs())
        b = len(key[1])
        self.recorder.replay(self.graphs[self._size])
        tokens = self.next_ids[:b].tolist()
        self._expect = (key[0], key[1], tuple(p + 1 for p in key[2]))
        return tokens
