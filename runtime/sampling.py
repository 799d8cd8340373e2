"""Sampling parameters and the sampler: greedy, or temperature / top-k / top-p with a per-sequence
seeded generator (the same seed gives the same tokens whatever else is in the batch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """max_tokens: tokens to generate (fewer if an EOS comes first, unless ignore_eos).
    temperature 0: greedy (argmax). top_k 0: no limit. top_p 1.0: no nucleus cut.
    seed: sequence i of a generate() call samples from torch.Generator seeded with seed + i;
    None: a fresh random seed."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        def number(name, lo, hi=None, integer=False, lo_open=False):
            v = getattr(self, name)
            kinds = (int,) if integer else (int, float)
            if isinstance(v, bool) or not isinstance(v, kinds):
                raise TypeError(f"SamplingParams.{name} must be {'an int' if integer else 'a number'}, "
                                f"got {type(v).__name__}")
            if v < lo or (lo_open and v == lo) or (hi is not None and v > hi):
                rng = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}{']' if hi is not None else ')'}"
                raise ValueError(f"SamplingParams.{name} must be in {rng}, got {v}")

        number("max_tokens", 1, integer=True)
        number("temperature", 0.0)
        number("top_k", 0, integer=True)
        number("top_p", 0.0, 1.0, lo_open=True)
        if self.seed is not None:
            number("seed", 0, integer=True)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams, index: int, device) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed + index)
    return g


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from logits (vocab,) fp32."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[0]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, idx = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, 0) - sorted_probs        # mass of the better tokens
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)  # the best token always stays
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """One token per row of logits (B, vocab)."""
    if all(p.greedy for p in params):
        return torch.argmax(logits, dim=-1).tolist()
    return [sample_one(logits[i], p, g) for i, (p, g) in enumerate(zip(params, generators))]
