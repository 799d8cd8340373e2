"""A minimal DeepSeek runtime on Tilecraft's ops: paged latent KV cache (page 64, block tables),
chunked prefill then batched decode (CUDA graphs on a GPU), greedy and seeded sampling.

    from runtime import LLM, SamplingParams
    llm = LLM("path/to/checkpoint", max_num_seqs=8, max_model_len=4096)
    outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=16))
"""

from runtime.kv_cache import PAGE_SIZE, BlockAllocator, OutOfBlocks, PagedLatentCache
from runtime.llm import LLM, Stats
from runtime.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "Stats", "PagedLatentCache", "BlockAllocator", "OutOfBlocks", "PAGE_SIZE"]
