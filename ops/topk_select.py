"""Row-wise exact top-k over long rows (sparse-attention indexer, sampling).

indices[r] = the k largest of scores[r, :lengths[r]], ties toward the lower index, returned in
ascending index order; rows shorter than k are padded with -1.

Kernel: one block per row, radix select on order-preserving 32-bit keys (4 passes of 8-bit
digits: a shared-memory histogram per pass narrows the k-th largest key), then one pass that
writes the chosen indices in order with two block-wide prefix sums per chunk (values above the
threshold, and the first `needed` of those equal to it).
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import tilelang.language as T
import torch

from codegen import targets, tile
from codegen.program import tile_program
from ops import _dispatch, _values
from ops import _validate as check

MAX_K = 4096


def _key(x):
    """float32 -> uint32 with the same order (negative floats reversed; -0.0 and +0.0 equal)."""
    bits = T.reinterpret(x, "uint32")
    key = T.if_then_else(x < 0, bits ^ T.uint32(0xFFFFFFFF), bits | T.uint32(0x80000000))
    return T.if_then_else(x == 0, T.uint32(0x80000000), key)


# Ascend: TileLang 0.1.15 has no cumsum lowering there yet (needs a rule for codegen.tile.cumsum)
@tile_program("topk_select", targets=("cuda:sm_90a", "cuda:sm_100a", "cpu"),
              examples={"indexer-2048": dict(k=2048), "sampling-512": dict(k=512)})
def topk_select_program(k: int, chunk: int = 1024, threads: int = 256):
    """Exact top-k per row by radix select; ascending indices, -1 padding for short rows."""
    rows, cols = T.dynamic("rows, cols")
    RADIX = 256

    @T.prim_func
    def topk_select(Scores: T.Tensor((rows, cols), "float32"), Lengths: T.Tensor((rows,), "int32"),
                    Out: T.Tensor((rows, k), "int32")):
        with tile.grid(rows, threads) as r:
            with tile.vector():
                hist = tile.stage((RADIX,), "int32")
                flag_gt = tile.fragment((chunk,), "int32")
                flag_eq = tile.fragment((chunk,), "int32")
                scan = tile.fragment((chunk,), "int32")
                total = tile.fragment((1,), "int32")
                n = T.alloc_var("int32")
                want = T.alloc_var("int32")        # how many of the remaining candidates we still need
                prefix = T.alloc_var("uint32")     # the k-th largest key, built 8 bits at a time
                cum = T.alloc_var("int32")
                found = T.alloc_var("int32")
                base = T.alloc_var("int32")
                eq_base = T.alloc_var("int32")
                n = T.min(T.max(Lengths[r], 0), cols)
                want = T.min(k, n)
                prefix = T.uint32(0)
                for p in tuple(range(4)):  # unrolled while tracing: digits from the top
                    shift = 24 - 8 * p
                    for b in tile.parallel(RADIX):
                        hist[b] = 0
                    for c in T.serial(T.ceildiv(n, chunk)):
                        for i in tile.parallel(chunk):
                            idx = c * chunk + i
                            key = _key(Scores[r, T.min(idx, cols - 1)])
                            same_prefix = (key >> T.uint32(shift + 8)) == (prefix >> T.uint32(shift + 8)) if p > 0 else True
                            if idx < n and same_prefix:
                                tile.atomic_add(hist[T.cast((key >> T.uint32(shift)) & T.uint32(255), "int32")], 1)
                    # the digit where the count of larger-or-equal candidates reaches `want`
                    cum = 0
                    found = -1
                    for j in T.serial(RADIX):
                        b = RADIX - 1 - j
                        if found < 0 and want > 0:
                            if cum + hist[b] >= want:
                                found = b
                                want = want - cum
                            cum = cum + hist[b]
                    prefix = prefix | (T.cast(T.max(found, 0), "uint32") << T.uint32(shift))
                # write: every key above the threshold, then the first `want` keys equal to it
                base = 0
                eq_base = 0
                for c in T.serial(T.ceildiv(n, chunk)):
                    for i in tile.parallel(chunk):
                        idx = c * chunk + i
                        key = _key(Scores[r, T.min(idx, cols - 1)])
                        flag_gt[i] = T.if_then_else(idx < n and key > prefix, 1, 0)
                        flag_eq[i] = T.if_then_else(idx < n and key == prefix, 1, 0)
                    tile.cumsum(flag_eq, scan, dim=0)
                    for i in tile.parallel(chunk):
                        flag_eq[i] = T.if_then_else(flag_eq[i] == 1 and eq_base + scan[i] <= want, 1, 0)
                    tile.row_reduce(flag_eq, total, "sum", dim=0)
                    eq_base = eq_base + total[0]
                    for i in tile.parallel(chunk):
                        flag_gt[i] = flag_gt[i] + flag_eq[i]
                    tile.cumsum(flag_gt, scan, dim=0)
                    for i in tile.parallel(chunk):
                        if flag_gt[i] == 1:
                            Out[r, T.min(base + scan[i] - 1, k - 1)] = c * chunk + i
                    tile.row_reduce(flag_gt, total, "sum", dim=0)
                    base = base + total[0]
                for i in tile.parallel(k):
                    if i >= T.min(k, n):
                        Out[r, i] = -1

    return topk_select


def topk_select_reference(scores, k, *, lengths=None):
    """torch reference: same ordering and padding, ties toward the lower index (stable sort)."""
    R, N = scores.shape
    out = torch.full((R, k), -1, dtype=torch.int32, device=scores.device)
    for r in range(R):
        n = N if lengths is None else max(0, min(N, int(lengths[r])))
        if n == 0:
            continue
        top = torch.sort(scores[r, :n].float(), descending=True, stable=True).indices[:min(k, n)]
        out[r, :top.numel()] = top.sort().values.to(torch.int32)
    return out


def _impl(scores, k, lengths):
    R, N = scores.shape
    out = torch.empty(R, k, dtype=torch.int32, device=scores.device)
    if R == 0:
        return out
    if N == 0:
        return out.fill_(-1)
    if lengths is None:
        lengths = torch.full((R,), N, dtype=torch.int32, device=scores.device)
    kernel = topk_select_program.compile(targets.resolve(scores), k=k)
    kernel.launcher()(scores, lengths, out)
    return out


@torch.library.custom_op("tilecraft::topk_select", mutates_args=())
def _topk_op(scores: torch.Tensor, k: int, lengths: torch.Tensor | None) -> torch.Tensor:
    return _impl(scores, k, lengths)


@_topk_op.register_fake
def _(scores, k, lengths):
    return scores.new_empty(scores.shape[0], k, dtype=torch.int32)


def topk_select(scores, k, *, lengths=None):
    """Indices of the k largest values of each row: (R, k) int32, ascending, -1 past a short row.

    scores (R, N) fp32 (bf16/fp16 are upcast); lengths (R,) int32 limits row r to its first
    lengths[r] columns. Exact; ties go to the lower index. NaN scores raise ValueError.
    """
    check.tensor("scores", scores, dtypes=(torch.float32, torch.bfloat16, torch.float16), ndim=2)
    check.number("k", k, lo=1, hi=MAX_K, integer=True)
    if lengths is not None:
        check.tensor("lengths", lengths, dtypes=(torch.int32,), ndim=1, contiguous=True)
        check.shape("lengths", lengths, (scores.shape[0],), "(rows,)")
        check.same_device(scores=scores, lengths=lengths)
    if scores.dtype != torch.float32 or not scores.is_contiguous():
        scores = scores.float().contiguous()
    if _values.enabled(scores) and scores.numel() and bool(torch.isnan(scores).any()):
        raise ValueError("scores must not contain NaN (there is no order to pick them by)")
    return _dispatch.call(_topk_op, _impl, scores, int(k), lengths)
