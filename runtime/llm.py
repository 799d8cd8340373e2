"""LLM: load a DeepSeek-V3 checkpoint, prefill prompts into the paged latent cache, decode in batches.

Scheduling is continuous batching at its simplest: up to max_num_seqs sequences run at once;
when some finish, waiting prompts are prefilled (in chunks of max_num_batched_tokens tokens, a
long prompt over several chunks) and join the decode batch. Each sequence reserves the cache
blocks for prompt + max_tokens when admitted, so a running sequence never waits for memory.
Decode steps replay CUDA graphs on a GPU (enforce_eager=True: plain eager steps).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from model import kernels
from model.config import load_config
from model.deepseek_v3 import DeepseekV3
from model.mla import AttentionBatch
from runtime.cuda_graph import DecodeGraphs
from runtime.kv_cache import PAGE_SIZE, PagedLatentCache
from runtime.sampling import SamplingParams, make_generator, sample


@dataclass
class _Seq:
    index: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    blocks: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    num_cached: int = 0          # tokens whose latents are in the cache
    done: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class Stats:
    """Wall time of the last generate()'s phases (device-synchronized at phase ends)."""

    prefill_s: float = 0.0
    prefill_tokens: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0


class LLM:
    """A DeepSeek-V3 checkpoint ready to generate.

    device: None = "cuda" when available, else "cpu". dtype: None = bf16 on a GPU, fp32 on the CPU.
    max_num_seqs: sequences decoded together. max_model_len: prompt + generated tokens per sequence
    (default min(max_position_embeddings, 4096)); the cache holds max_num_seqs such sequences.
    max_num_batched_tokens: prompt tokens per prefill step (longer prompts take several chunks).
    enforce_eager: no CUDA graphs for decode. keep_fp8: keep FP8 weights as e4m3 + scales and run
    them through fp8_linear (default: dequantize to dtype at load).
    """

    def __init__(self, model_dir, device=None, dtype=None, max_num_seqs: int = 8, max_model_len: int | None = None, *,
                 max_num_batched_tokens: int = 2048, enforce_eager: bool = False, keep_fp8: bool = False):
        for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
                                          or max_model_len < 2):
            raise ValueError(f"max_model_len must be an int >= 2, got {max_model_len!r}")
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        config = load_config(model_dir)
        if max_model_len is None:
            max_model_len = min(config.max_position_embeddings, 4096)
        self.config, self.max_num_seqs, self.max_model_len = config, max_num_seqs, max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.model = DeepseekV3.from_pretrained(model_dir, self.device, dtype, max_positions=max_model_len,
                                                keep_fp8=keep_fp8)
        self.dtype = dtype
        self.blocks_per_seq = -(-max_model_len // PAGE_SIZE)
        self.cache = PagedLatentCache(config.num_hidden_layers, max_num_seqs * self.blocks_per_seq + 1,
                                      config.latent_dim, dtype, self.device)
        self.use_cuda_graphs = self.device.type == "cuda" and not enforce_eager
        self._graphs = DecodeGraphs(self.model, self.cache, max_num_seqs, self.blocks_per_seq) \
            if self.use_cuda_graphs else None
        self.stats = Stats()
        self._op_profile: dict | None = None
        self._generation = 0

    # ---- public API --------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompt_token_ids: list[list[int]], sampling_params: SamplingParams | list | None = None, *,
                 progress: bool = False) -> list[list[int]]:
        """Generate for each prompt; returns each prompt's generated token ids (prompt excluded).

        sampling_params: one SamplingParams for every prompt, or a list with one per prompt.
        progress: show a progress bar of generated tokens (and of prefill chunks)."""
        prompts = self._check_prompts(prompt_token_ids)
        params = self._check_params(sampling_params, len(prompts))
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if len(p) + sp.max_tokens > self.max_model_len:
                raise ValueError(f"prompt_token_ids[{i}] has {len(p)} tokens; with max_tokens={sp.max_tokens} that "
                                 f"exceeds max_model_len={self.max_model_len}")
        seqs = [_Seq(i, p, sp, make_generator(sp, i, self.device)) for i, (p, sp) in enumerate(zip(prompts, params))]
        self._generation += 1                   # graph-held decode state never carries over between calls
        self.stats = Stats()
        bar = _progress(progress, sum(sp.max_tokens for sp in params), "generate")
        waiting, running = deque(seqs), []
        try:
            while waiting or running:
                admitted = []
                while waiting and len(running) + len(admitted) < self.max_num_seqs:
                    s = waiting.popleft()
                    s.blocks = self.cache.allocator.allocate(self.cache.blocks_for(len(s.prompt) + s.params.max_tokens))
                    admitted.append(s)
                if admitted:
                    t0 = time.perf_counter()
                    logits = self._prefill(admitted, all_logits=False, progress=progress)
                    self._append(admitted, self._sample(admitted, torch.cat(logits)), bar)
                    self.stats.prefill_s += self._elapsed(t0)
                    self.stats.prefill_tokens += sum(len(s.prompt) for s in admitted)
                    running += admitted
                running = self._retire(running)
                if running:
                    t0 = time.perf_counter()
                    self._append(running, self._decode_step(running), bar)
                    self.stats.decode_s += self._elapsed(t0)
                    self.stats.decode_steps += 1
                    self.stats.decode_tokens += len(running)
                    running = self._retire(running)
        finally:
            for s in seqs:
                if s.blocks:
                    self.cache.allocator.free(s.blocks)
                    s.blocks = []
            bar.close()
        return [s.output for s in seqs]

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits (len(token_ids), vocab) fp32 on the CPU: row i predicts token i + 1 (one prefill)."""
        (prompt,) = self._check_prompts(token_ids, name="token_ids", nested=False)
        if len(prompt) > self.max_model_len:
            raise ValueError(f"token_ids has {len(prompt)} tokens, more than max_model_len={self.max_model_len}")
        s = _Seq(0, prompt, SamplingParams(max_tokens=1), None)
        s.blocks = self.cache.allocator.allocate(self.cache.blocks_for(len(prompt)))
        try:
            return torch.cat(self._prefill([s], all_logits=True)).cpu()
        finally:
            self.cache.allocator.free(s.blocks)

    # ---- steps -------------------------------------------------------------------------------------

    def _prefill(self, seqs: list[_Seq], all_logits: bool, progress: bool = False) -> list[torch.Tensor]:
        """Run the prompts through the model in token-budget chunks. Returns, per sequence, the
        logits of its last prompt token (1, V), or of every prompt token when all_logits."""
        out: list[list[torch.Tensor]] = [[] for _ in seqs]
        total = sum(len(s.prompt) for s in seqs)
        bar = _progress(progress and total > self.max_num_batched_tokens, total, "prefill")
        pending = list(range(len(seqs)))
        while pending:
            budget, chunk = self.max_num_batched_tokens, []
            for i in pending:
                s = seqs[i]
                n = min(len(s.prompt) - s.num_cached, budget)
                if n == 0:
                    break
                chunk.append((i, s.num_cached, s.num_cached + n))
                budget -= n
            ids, positions, slots, rows, query_lens, context_lens = [], [], [], [], [], []
            for i, start, end in chunk:
                s = seqs[i]
                ids += s.prompt[start:end]
                positions += range(start, end)
                slots += self.cache.slots(s.blocks, start, end)
                if all_logits:
                    rows += range(len(ids) - (end - start), len(ids))
                elif end == len(s.prompt):
                    rows.append(len(ids) - 1)
                query_lens.append(end - start)
                context_lens.append(end)
            dev = self.device
            batch = AttentionBatch(
                torch.tensor(positions, device=dev), torch.tensor(slots, device=dev),
                self.cache.block_table([seqs[i].blocks for i, _, _ in chunk], self.blocks_per_seq),
                torch.tensor(context_lens, dtype=torch.int32, device=dev), decode=False,
                query_lens=query_lens, context_lens=context_lens)
            logits = self.model.forward(torch.tensor(ids, device=dev), batch, self.cache.layers,
                                        torch.tensor(rows, dtype=torch.long, device=dev))
            at = 0
            for i, start, end in chunk:
                take = (end - start) if all_logits else int(end == len(seqs[i].prompt))
                if take:
                    out[i].append(logits[at:at + take])
                    at += take
                seqs[i].num_cached = end
            pending = [i for i in pending if seqs[i].num_cached < len(seqs[i].prompt)]
            bar.update(sum(e - s for _, s, e in chunk))
        bar.close()
        return [torch.cat(o) for o in out]

    def _decode_inputs(self, seqs: list[_Seq], positions: list[int]):
        """(ids, positions, block_table, seqlens) of a decode step, on the device (the cache slots
        follow from the block table and the positions)."""
        dev = self.device
        ids = torch.tensor([s.tokens[-1] for s in seqs], device=dev)
        pos = torch.tensor(positions, device=dev)
        table = self.cache.block_table([s.blocks for s in seqs], self.blocks_per_seq)
        seqlens = torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=dev)
        return ids, pos, table, seqlens

    def _decode(self, seqs: list[_Seq]) -> torch.Tensor:
        """One token for each running sequence; returns logits (B, vocab) fp32."""
        dev = self.device
        positions = [s.num_cached for s in seqs]
        ids, pos, table, seqlens = self._decode_inputs(seqs, positions)
        if self.use_cuda_graphs and self._op_profile is None:
            for s in seqs:
                s.num_cached += 1
            return self._graphs.run(ids, pos, table, seqlens)
        slots = torch.tensor([self.cache.slots(s.blocks, p, p + 1)[0] for s, p in zip(seqs, positions)], device=dev)
        for s in seqs:
            s.num_cached += 1
        batch = AttentionBatch(pos, slots, table, seqlens, decode=True)
        if self._op_profile is None:
            return self.model.forward(ids, batch, self.cache.layers)
        with kernels.profile(dev) as prof:                  # eager, every op timed by family
            logits = self.model.forward(ids, batch, self.cache.layers)
        for k, (sec, calls) in prof.items():
            acc = self._op_profile.setdefault(k, [0.0, 0])
            acc[0] += sec
            acc[1] += calls
        return logits

    def _decode_step(self, seqs: list[_Seq]) -> list[int]:
        """One decode step: the next token of each running sequence.

        With CUDA graphs, greedy sampling and no op profiling, the graph itself picks the tokens
        (argmax) and advances its own inputs (ids, positions, slots, lengths) for the next step, so
        a step that continues the previous one's batch copies nothing to the device and reads back
        only the B token ids. Any other step takes the general path: inputs from the host, logits
        back, sampling on the host."""
        if self.use_cuda_graphs and self._op_profile is None and all(s.params.greedy for s in seqs):
            positions = [s.num_cached for s in seqs]
            key = (self._generation, tuple(s.index for s in seqs), tuple(positions))
            tokens = self._graphs.run_greedy(key, lambda: self._decode_inputs(seqs, positions))
            for s in seqs:
                s.num_cached += 1
            return tokens
        return self._sample(seqs, self._decode(seqs))

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> list[int]:
        return sample(logits, [s.params for s in seqs], [s.generator for s in seqs])

    def _append(self, seqs: list[_Seq], tokens: list[int], bar) -> None:
        eos = set(self.config.eos_token_ids)
        for s, t in zip(seqs, tokens):
            s.output.append(t)
            bar.update(1)
            if len(s.output) >= s.params.max_tokens or (t in eos and not s.params.ignore_eos):
                s.done = True

    def _retire(self, running: list[_Seq]) -> list[_Seq]:
        for s in running:
            if s.done and s.blocks:
                self.cache.allocator.free(s.blocks)
                s.blocks = []
        return [s for s in running if not s.done]

    def _elapsed(self, t0: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    # ---- input checks ------------------------------------------------------------------------------

    def _check_prompts(self, prompts, name="prompt_token_ids", nested=True) -> list[list[int]]:
        vocab = self.config.vocab_size
        if not nested:
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"{name} must be a list of token-id lists, got {type(prompts).__name__}")
        out = []
        for i, p in enumerate(prompts):
            where = f"{name}[{i}]" if nested else name
            if isinstance(p, torch.Tensor):
                p = p.tolist()
            if not isinstance(p, (list, tuple)):
                raise TypeError(f"{where} must be a list of ints, got {type(p).__name__}")
            if len(p) == 0:
                raise ValueError(f"{where} is empty; a prompt needs at least one token")
            for t in p:
                if isinstance(t, bool) or not isinstance(t, int):
                    raise TypeError(f"{where} must contain ints, got {type(t).__name__}")
                if not 0 <= t < vocab:
                    raise ValueError(f"{where} has token id {t}, outside the vocabulary [0, {vocab})")
            out.append(list(p))
        return out

    @staticmethod
    def _check_params(params, n: int) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * n
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError("sampling_params must be a SamplingParams or a list of them, "
                            f"got {type(params).__name__}")
        if len(params) != n:
            raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
        return list(params)


class _NoBar:
    def update(self, n=1):
        pass

    def close(self):
        pass


def _progress(enabled: bool, total: int, desc: str):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", dynamic_ncols=True)


def profile_decode(llm: LLM, prompts, params: SamplingParams) -> tuple[dict, Stats]:
    """Generate once with eager decode steps, timing each op family (device-synchronized around every
    op) during decode only. Returns ({family: [seconds, calls]}, that run's Stats)."""
    llm._op_profile = {}
    try:
        llm.generate(prompts, params)
        return llm._op_profile, llm.stats
    finally:
        llm._op_profile = None
