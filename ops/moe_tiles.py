"""Work items for the sorted-rows grouped GEMM: which expert and rows each GEMM block takes.

After `moe_dispatch(layout="contiguous", align=1)` the T*k rows are sorted by expert with no
padding: expert e owns rows [start_e, start_e + counts[e]), start_e = sum of the counts before e.
moe_tile_items cuts each expert's rows into chunks of block_m and lists them as
(expert, first row, row count) items, padded with (-1, 0, 0) to a fixed length. The length is a
bound that holds for every routing (sum_e ceil(counts[e] / block_m) <= ceil(R / block_m) + E for R
rows), so a GEMM launched with one block per item has a fixed grid: CUDA-graph capturable. The
list is built with device ops only (cumsum, searchsorted, arange, gathers): nothing is read on the
host.
"""

import torch

from ops import _values
from ops import _validate as check
from ops.moe_dispatch import MoeMapping


def _items(counts, max_items: int, block_m: int) -> torch.Tensor:
    """(max_items, 3) int32 from per-expert row counts (E,): device ops only."""
    device = counts.device
    c = counts.long()
    tiles = (c + block_m - 1) // block_m                                # [E] items of each expert
    tile_end = torch.cumsum(tiles, 0)                                   # [E] inclusive
    row_start = torch.cumsum(c, 0) - c                                  # [E] first row of each expert
    i = torch.arange(max_items, device=device)                          # [I]
    # the expert of item i: how many experts end at or before i (empty experts end where the last did)
    e = torch.searchsorted(tile_end, i, right=True)                     # [I], E for padding items
    live = e < c.numel()
    ec = e.clamp(max=max(c.numel() - 1, 0))
    j = i - (tile_end[ec] - tiles[ec])                                  # chunk index within the expert
    row0 = row_start[ec] + j * block_m
    nrows = torch.minimum(c[ec] - j * block_m, torch.full_like(j, block_m))
    items = torch.stack([torch.where(live, ec, -1), torch.where(live, row0, 0), torch.where(live, nrows, 0)], 1)
    return items.to(torch.int32).contiguous()


def moe_tile_items(mapping_or_counts, num_experts, block_m=64, max_items=None, *, rows=None):
    """(max_items, 3) int32 work items (expert, first row, row count) over rows sorted by expert.

    mapping_or_counts: the MoeMapping of `moe_dispatch(..., layout="contiguous", align=1)` (its
    counts, and its T*k rows as R), or counts (E,) int32/int64 rows per expert on any device, whose
    rows are taken to lie back to back in expert order from row 0 (then give R as `rows=`, or
    max_items). Each expert's rows are covered by ceil(counts[e] / block_m) items of at most
    block_m rows, experts in order; the rest of the list is (-1, 0, 0). max_items defaults to
    ceil(R / block_m) + E, enough for any routing of R rows. Nothing is read on the host (CUDA-graph
    capturable); with value checks on (not capturing), a max_items too small for these counts
    raises, and with them off the items past max_items are dropped.
    """
    check.number("num_experts", num_experts, lo=1, integer=True)
    check.number("block_m", block_m, lo=1, integer=True)
    if isinstance(mapping_or_counts, MoeMapping):
        m = mapping_or_counts
        if m.layout != "contiguous" or m.m_indices is None:
            raise ValueError(f"mapping must come from moe_dispatch(layout='contiguous', align=1), got layout {m.layout!r}")
        if m.num_experts != num_experts:
            raise ValueError(f"num_experts={num_experts} does not match the mapping's {m.num_experts}")
        counts = m.counts
        if m.m_indices.shape[0] != m.positions.numel():
            raise ValueError(f"the mapping has {m.m_indices.shape[0]} rows for {m.positions.numel()} (token, choice) "
                             "pairs: it was dispatched with padding (align > 1); use align=1")
        if rows is not None and rows != m.m_indices.shape[0]:
            raise ValueError(f"rows={rows} does not match the mapping's {m.m_indices.shape[0]} rows")
        rows = m.m_indices.shape[0]
    else:
        counts = mapping_or_counts
        check.tensor("counts", counts, dtypes=(torch.int32, torch.int64), ndim=1)
        check.shape("counts", counts, (num_experts,), "(num_experts,) rows per expert")
        if rows is not None:
            check.number("rows", rows, lo=0, integer=True)
    if max_items is None:
        if rows is None:
            raise ValueError("give rows= (the total row count R) or max_items: the default max_items is "
                             "ceil(R / block_m) + num_experts, and R is not read from the device")
        max_items = -(-rows // block_m) + num_experts
    check.number("max_items", max_items, lo=0, integer=True)
    if _values.enabled(counts) and counts.numel():
        if bool((counts < 0).any()):
            raise ValueError("counts must be >= 0")
        need = int(((counts.long() + block_m - 1) // block_m).sum())
        if need > max_items:
            raise ValueError(f"max_items={max_items} is smaller than the {need} items these counts need")
        if rows is not None and int(counts.long().sum()) > rows:
            raise ValueError(f"counts sum to {int(counts.long().sum())} rows, more than rows={rows}")
    return _items(counts, max_items, block_m)


def moe_tile_items_reference(counts, block_m, max_items):
    """The same list built by a Python loop over the experts (for tests)."""
    out, start = [], 0
    for e, c in enumerate(int(v) for v in counts):
        for j in range(0, c, block_m):
            out.append([e, start + j, min(block_m, c - j)])
        start += c
    out = out[:max_items] + [[-1, 0, 0]] * max(0, max_items - len(out))
    return torch.tensor(out, dtype=torch.int32).view(max_items, 3)
