"""Expert-parallel MoE dispatch and combine: ops.moe_dispatch / ops.moe_combine with group=.

A torch.distributed ProcessGroup of W ranks: rank r owns experts [r*E/W, (r+1)*E/W). Two
transports (ep_transport: EP_TRANSPORT / TILECRAFT_EP_TRANSPORT, the same on every rank): "peer"
(ops/moe_ep_peer.py: ranks on one host map each other's buffers; the default on an NCCL group whose
ranks share a host) and "a2a", this module's all_to_all_single path, described here:
  dispatch: every (token, choice) is sent once to the rank owning its expert (one row per choice, not
    one per destination rank: k rows per token cross the fabric, but each returns as its own row, so
    combine can sum in the single-device order). A rank's tokens are cut into C = EP_CHUNKS token
    ranges; its send order is (chunk, global expert, token): the single-device plan kernels on the key
    chunk*E + expert, so each chunk is grouped by destination rank and, inside, by local expert. One
    (C*E + 8,) int32 header per rank goes first with all_gather_into_tensor (the count kernel's rows
    per (chunk, global expert), then an error flag, row sizes and the ids' range) and is read on the
    host (the one sync). From it each receiver knows its whole layout before any row arrives: expert
    e's rows are, in the single-device order, rank 0's chunks 0..C-1, then rank 1's...; so every
    received row's output row follows from two small host tables (per segment, per expert), which one
    kernel (moe_ep_layout) expands on the device: no ids exchange. Then, per chunk, the send rows are
    scattered from x (token-major: each token read once), exchanged with all_to_all_single on raw bytes (uint8 views:
    any dtype, NCCL or gloo; fp8 scales as a second exchange), issued async on CUDA (the process
    group's stream), and placed into the final layout as soon as they arrive, while the next chunk
    transfers. The result is exactly the slice of the single-device layout for the local experts
    (rows in global token order inside each expert, the same padding, zeros included).
  combine: per chunk, this rank's expert rows are gathered in their arrival order and go back to their
    tokens' ranks (all_to_all_single, async on CUDA); as chunk c returns, its tokens (exactly the rows
    of chunk c) run the single-device combine kernel: same values, same order, same fp32 accumulation,
    so the output is bitwise the single-device result on the concatenated tokens.
  Every rank runs the same collectives in the same order (C chunk exchanges even when they are
  empty), so uneven loads, empty ranks and empty experts cannot deadlock.
  The EP path reads the header on the host (split sizes), so it is eager only: no CUDA-graph capture,
  no torch.compile. This module sets no NCCL environment; launchers should keep NCCL_NVLS_ENABLE=0.
  Future work: send a token once per destination rank (DeepEP-style) and return per-choice rows;
  dispatch to EPLB replicas (ops.eplb_plan) by choosing a physical slot per (token, choice).
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import socket
import time
import weakref

import numpy as np
import tilelang.language as T
import torch
import torch.distributed as dist

from codegen import jit, targets, tile
from codegen.program import tile_program
from ops import _values
from ops import _validate as check
from ops._workspace import int32_views
from ops.moe_dispatch import (BITS_NAME, EpMapping, MoeMapping, _check_dispatch, combine_launcher,
                              gather_rows_program, plan_launchers, row_words, scatter_launcher)
from tilecraft import env

EP_CHUNKS = 4        # row exchanges per EP dispatch/combine (token ranges), "a2a" transport; the same on every rank
EP_TRANSPORT = None  # "auto", "a2a" or "peer"; None: TILECRAFT_EP_TRANSPORT. The same on every rank
TRANSPORTS = ("auto", "a2a", "peer")
_EP_TRACE = None     # bench hook (bench/suites/moe.py): a list collecting (phase, CUDA event or wall time)


@tile_program("moe_ep_layout", targets=("cuda:sm_90a", "cuda:sm_100a", "cpu"), examples={"default": {}})
def ep_layout_program(threads: int = 256):
    """An EP receiver's layout from two small host tables (one block per segment or expert):
    Pos[Seg[s,0] + j] = Seg[s,2] + min(Seg[s,3] + j, cap) for j < Seg[s,1] (segment s: the rows one
    source rank sent from one chunk to one local expert: receive start, length, the expert's first
    output row, the segment's first index inside its expert); Rows[Exp[e,0] + j] = Exp[e,3] if
    j < Exp[e,1] else -1 for j < Exp[e,2] (contiguous: m_indices; masked: 0 / -1 row validity)."""
    nseg, el, n, rows = T.dynamic("nseg, el, n, rows")

    @T.prim_func
    def ep_layout(Seg: T.Tensor((nseg, 4), "int32"), Exp: T.Tensor((el, 4), "int32"), cap: T.int32,
                  Pos: T.Tensor((n,), "int32"), Rows: T.Tensor((rows,), "int32")):
        with tile.grid(nseg + el, threads) as b:
            with tile.vector():
                if b < nseg:
                    for p in T.serial(T.ceildiv(Seg[b, 1], threads)):
                        for t in tile.parallel(threads):
                            if p * threads + t < Seg[b, 1]:
                                Pos[Seg[b, 0] + p * threads + t] = Seg[b, 2] + T.min(Seg[b, 3] + p * threads + t, cap)
                else:
                    for p in T.serial(T.ceildiv(Exp[b - nseg, 2], threads)):
                        for t in tile.parallel(threads):
                            if p * threads + t < Exp[b - nseg, 2]:
                                Rows[Exp[b - nseg, 0] + p * threads + t] = T.if_then_else(
                                    p * threads + t < Exp[b - nseg, 1], Exp[b - nseg, 3], -1)

    return ep_layout


def _group_size_rank(group):
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group was given but torch.distributed is not initialized: call "
                         "torch.distributed.init_process_group first, or pass group=None for one device")
    try:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
    except (TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise TypeError(f"group must be a torch.distributed ProcessGroup, got {type(group).__name__} ({e})") from e
    if rank < 0:
        raise ValueError("this process is not a member of group")
    return world, rank


def _a2a(out, inp, out_splits, in_splits, group):
    """all_to_all_single of rows as raw bytes (uint8 views: any dtype crosses any backend; gloo has no
    fp8). On CUDA it is issued async on the process group's stream and the handle is returned (wait()
    makes the current stream wait); on CPU it runs now and None is returned."""
    o, i = out.view(torch.uint8), inp.view(torch.uint8)               # 2-D (rows, row bytes)
    cuda = out.device.type == "cuda"
    work = dist.all_to_all_single(o, i, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits),
                                  group=group, async_op=cuda)
    return work if cuda else None


def _mark(name, device):
    """Bench hook: with _EP_TRACE a list, record a phase boundary (a CUDA event on the current stream,
    or the wall time on CPU). Costs nothing when off."""
    if _EP_TRACE is None:
        return
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        _EP_TRACE.append((name, ev))
    else:
        _EP_TRACE.append((name, time.perf_counter()))


def _ep_chunks():
    c = EP_CHUNKS
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise ValueError(f"ops.moe_ep.EP_CHUNKS must be an int >= 1 (the same on every rank), got {c!r}")
    return c


def _token_bounds(tokens, chunks):
    """Chunk c of a rank's tokens is [c*T//C, (c+1)*T//C): some chunks are empty when T < C."""
    return [c * tokens // chunks for c in range(chunks + 1)]


def _scatter_into(y, x, positions, src, pad):
    """y[positions[t, j]] = x[t] for the rows of x (raw bits), and with pad zeros where src < 0 (src
    covers y's rows). x, positions may be row slices: the kernel reads whole rows, so a slice keeps
    the alignment of its base."""
    target = targets.resolve(x)
    xw = x.view(row_words(x, target))
    scatter_launcher(target, xw.shape[1], xw.dtype, pad)(xw, positions, src, y.view(xw.dtype))


def _gather_into(y, x, src):
    """y[r] = x[src[r]] for every row of y (a row slice of a larger buffer), on raw bits."""
    target = targets.resolve(x)
    xw = x.view(row_words(x, target))
    hidden, bits = xw.shape[1], xw.dtype
    gather = jit.launchers(("moe_gather_rows", target.name, hidden, bits), lambda: (
        gather_rows_program.compile(target, hidden=hidden, bits=BITS_NAME[bits]).launcher()))
    gather(xw, src, y.view(bits))


_CHUNK_BASES = {}


def _chunk_base(tokens, chunks, num_experts, device):
    """(T, 1) int32: chunk(t) * E, chunk(t) = ((t + 1) * C - 1) // T (the chunk of _token_bounds
    holding token t); kept for the last few shapes (five small ops fewer per call)."""
    key = (tokens, chunks, num_experts, device)
    base = _CHUNK_BASES.get(key)
    if base is None:
        t = torch.arange(1, tokens + 1, device=device, dtype=torch.int32)
        base = ((t * chunks - 1) // tokens * num_experts).view(tokens, 1)
        if len(_CHUNK_BASES) >= 16:
            _CHUNK_BASES.clear()
        _CHUNK_BASES[key] = base
    return base


def _ep_send_plan(ids, num_experts, chunks, counts, stats=None):
    """Send order of an EP dispatch: every (token, choice) sorted by (chunk, global expert), token order
    inside, i.e. by (chunk, destination rank, local expert, token). It is the single-device plan
    (contiguous, align=1) on the key chunk(t)*E + ids[t, j] over C*E keys: chunk c's rows are exactly
    rows [c0*k, c1*k) of the send buffer. The count runs now, into `counts` (C*E,) int32 (the
    header's first part), its stats (padded total, busiest, out-of-range ids, 0) into `stats` when
    given; the place step is returned, to run later (under the header exchange): it
    gives positions (T, k) int32 and the source token of every send row (into `src` (T*k,) int32
    when given)."""
    T_, k = ids.shape
    E, device = num_experts * chunks, ids.device
    if chunks == 1:                 # the key is the expert: the kernels clamp it themselves
        flat = ids.view(-1)
    else:
        # [T, k] chunk(t)*E + expert; ids clamped like the single-device kernels (the range check,
        # when on, reads the raw ids): a chunk's rows then always fill exactly its own rows of the
        # send buffer
        flat = (ids.clamp(0, num_experts - 1) + _chunk_base(T_, chunks, num_experts, device)).view(-1)
    offsets, stats = int32_views(device, E + 1, 4) if stats is None else (int32_views(device, E + 1)[0], stats)
    target = targets.resolve(ids)
    count, place_rows = plan_launchers(target, E, "contiguous")
    count(flat, counts, offsets, stats, 1)

    def place(src=None):
        # positions; the source token of each send row; the key of each row (unused)
        positions, own_src, m_idx = int32_views(device, (T_, k), T_ * k, T_ * k)
        src = own_src if src is None else src
        place_rows(flat, counts, offsets, positions.view(-1), src, m_idx, k)
        return positions, src

    return place


def _recv_layout(cnt, layout, align, max_m):
    """This rank's dispatch layout from the header alone (no received ids), as two small tables for
    ep_layout_program (one launch expands them on the device: the ~25 small device ops this replaced
    took 0.58 ms of host time per dispatch on the H200 host, numpy over every row 0.45 ms here).

    cnt (W, C, El) int64 numpy: rows each source rank sends from each of its chunks to each local
    expert. In the single-device layout on the concatenated tokens, expert e's rows are in global
    token order: source rank 0's chunks 0..C-1, then rank 1's...; the receive buffer holds
    chunk-major segments (c, s, e). So a received row's index in its expert is (rows of e from
    earlier (s, c)) + its index in its segment."""
    W, C, El = cnt.shape
    tot = cnt.sum((0, 1))                                                # [El] rows per local expert
    n = int(tot.sum())
    busiest = int(tot.max()) if n else 0
    flat = cnt.reshape(W * C, El)
    before = (np.cumsum(flat, 0) - flat).reshape(W, C, El)              # rows of e in earlier (s, c)
    seg_len = cnt.transpose(1, 0, 2).reshape(-1)                         # receive order: (c, s, e)
    seg = np.empty((seg_len.size, 4), dtype=np.int64)
    seg[:, 0] = np.cumsum(seg_len) - seg_len
    seg[:, 1] = seg_len
    seg[:, 3] = before.transpose(1, 0, 2).reshape(-1)
    exp = np.empty((El, 4), dtype=np.int64)
    exp[:, 1] = tot
    if layout == "contiguous":
        padded = (tot + align - 1) // align * align
        rows = int(padded.sum())
        exp[:, 0] = np.cumsum(padded) - padded                           # expert segment starts
        exp[:, 2] = padded
        exp[:, 3] = np.arange(El)                                        # m_indices: the expert, -1 on padding
        cap, out_max_m, pad_rows = 2**31 - 1, None, rows - n
    else:
        out_max_m = int(max_m) if max_m is not None else max(align, (busiest + align - 1) // align * align)
        rows = El * out_max_m
        exp[:, 0] = np.arange(El) * out_max_m
        exp[:, 2] = out_max_m
        exp[:, 3] = 0                                                    # valid rows 0, padding -1
        # clamped like the single-device plan: an unchecked overflow never writes out of bounds
        cap, pad_rows = out_max_m - 1, rows - int(np.minimum(tot, out_max_m).sum())
    seg[:, 2] = np.tile(exp[:, 0], W * C)
    return dict(counts=tot, seg=seg, exp=exp, cap=cap, n=n, rows=rows, pad_rows=pad_rows, busiest=busiest,
                max_m=out_max_m)


def _expand_layout(device, lay):
    """(positions (N, 1), rows (M,), counts (El,)) int32 on the device: the tables uploaded in one
    copy, expanded by one ep_layout_program launch."""
    seg, exp, counts = _to_device(device, lay["seg"], lay["exp"], lay["counts"])
    pos = torch.empty(lay["n"], dtype=torch.int32, device=device)
    rows = torch.empty(lay["rows"], dtype=torch.int32, device=device)
    if seg.numel() + exp.numel():
        target = targets.resolve(pos)
        expand = jit.launchers(("moe_ep_layout", target.name), lambda: ep_layout_program.compile(target).launcher())
        expand(seg.view(-1, 4), exp.view(-1, 4), lay["cap"], pos, rows)
    return pos.view(-1, 1), rows, counts


def _to_device(device, *arrays):
    """int32 device copies of host int arrays through one pinned buffer and one copy."""
    sizes = [a.size for a in arrays]
    host = torch.empty(max(1, sum(sizes)), dtype=torch.int32, pin_memory=device.type == "cuda")
    flat = host.numpy()
    o = 0
    for a, n in zip(arrays, sizes):
        flat[o:o + n] = a.reshape(-1)
        o += n
    dev = host.to(device, non_blocking=True)
    out, o = [], 0
    for n in sizes:
        out.append(dev[o:o + n])
        o += n
    return out


# header tail (int32 after the counts): [bad arguments, x bytes per row, scale bytes per row, ids
# checked, ids min (a2a) or top_k (peer), ids max (a2a), tokens, transport (0 a2a; peer: 1 not
# staged, 2 staged), then the count kernel's stats (padded total, busiest, out-of-range ids, 0): peer]
_TAIL = 12
_TAILS = {}


_TAILS_CAPTURED = {}


def _tail(values, device):
    """The header tail as a device tensor, kept per value (a device copy, not an upload, per call)."""
    key = (tuple(values), device)
    t = _TAILS.get(key)
    if t is None:
        t = _TAILS_CAPTURED.get(key)
    capturing = torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
    if t is None:
        if len(_TAILS) >= 64:
            _TAILS.clear()
        if capturing:                        # no host-to-device copy under capture: fills (kernels) only
            t = torch.zeros(len(values), dtype=torch.int32, device=device)
            for i, v in enumerate(values):
                if v:
                    t[i].fill_(v)
        else:
            t = torch.tensor(values, dtype=torch.int32, device=device)
        _TAILS[key] = t
    if capturing and key not in _TAILS_CAPTURED:
        _TAILS_CAPTURED[key] = t             # a CUDA graph reads it at every replay: never dropped
    return t


def read_header(h, ce, num_experts, me, mode):
    """Check the all-gathered headers (W, ce + _TAIL) int64 on the host: this rank's bad ids, any
    rank's bad arguments, one row size and one transport across the group; returns the tails."""
    tails = h[:, ce:]
    # ranks that checked theirs: a2a reads the ids' range, peer the count kernel's out-of-range count
    bad_ids = [bool(t[3]) and (t[4] < 0 or t[5] >= num_experts or t[10] > 0) for t in tails]
    if bad_ids[me]:
        got = (f"{int(tails[me, 10])} ids out of range" if tails[me, 10] else
               f"values {int(tails[me, 4])}..{int(tails[me, 5])}")
        raise ValueError(f"ids must be expert ids in [0, {num_experts}), got {got}")
    failed = [r for r in range(len(tails)) if tails[r, 0] or bad_ids[r]]
    if failed:
        raise ValueError(f"moe_dispatch: rank(s) {failed} of the group got invalid arguments (see their errors); "
                         "no rows were exchanged")
    sizes = sorted({(int(t[1]), int(t[2])) for t in tails})
    if len(sizes) > 1:
        raise ValueError(f"every rank must send rows of one size: got (x bytes, x_scales bytes) per row "
                         f"{sizes} across the group (same H and dtype everywhere)")
    modes = sorted({"a2a" if t[7] == 0 else "peer" for t in tails})
    if modes != ["a2a" if mode == 0 else "peer"]:
        raise ValueError(f"the ranks of the group use different EP transports {modes}: set "
                         "TILECRAFT_EP_TRANSPORT (or ops.moe_ep.EP_TRANSPORT) the same on every rank")
    return tails


def _peer_capable(group):
    """Whether the peer transport can run on group: every rank on this host, on a CUDA device of its
    own that every other rank's device can map (P2P), with torch's symmetric memory. Asked once per
    group (two small collectives); a weak reference tells a new group from an old one of its name."""
    key = getattr(group, "group_name", id(group))
    known = _PEER_CAPABLE.get(key)
    if known is None or known[0]() is not group:
        world = dist.get_world_size(group)
        try:
            from torch.distributed import _symmetric_memory  # noqa: F401
            device = torch.cuda.current_device() if torch.cuda.is_available() else None
        except ImportError:
            device = None
        mine = (socket.gethostname(), device)
        every = [None] * world
        dist.all_gather_object(every, mine, group=group)
        devices = [d for _, d in every]
        ok = (len({h for h, _ in every}) == 1 and None not in devices and len(set(devices)) == world
              and all(d == device or torch.cuda.can_device_access_peer(device, d) for d in devices))
        votes = [None] * world
        dist.all_gather_object(votes, ok, group=group)
        known = _PEER_CAPABLE[key] = (weakref.ref(group), all(votes))
    return known[1]


_PEER_CAPABLE = {}


def ep_transport(group):
    """The transport of an EP dispatch/combine over group: EP_TRANSPORT, else TILECRAFT_EP_TRANSPORT;
    "auto" is "peer" on an NCCL group whose ranks share one host and map each other's GPUs (torch
    symmetric memory over NVLink or PCIe P2P), "a2a" (all_to_all_single) otherwise. The same on
    every rank of the group."""
    t = EP_TRANSPORT if EP_TRANSPORT is not None else env.get("TILECRAFT_EP_TRANSPORT")
    if t not in TRANSPORTS:
        raise ValueError(f"EP transport must be one of {TRANSPORTS}, got {t!r} (TILECRAFT_EP_TRANSPORT or "
                         "ops.moe_ep.EP_TRANSPORT)")
    if t == "auto":
        t = "peer" if dist.get_backend(group) == "nccl" and _peer_capable(group) else "a2a"
    return t


def ep_dispatch(x, ids, num_experts, x_scales, layout, align, max_m, group):
    """Expert-parallel dispatch: one header all-gather (with its host sync), then C row chunks whose
    send scatter, all-to-all and placement overlap (see the module docstring and bench/NOTES.md)."""
    world, me = _group_size_rank(group)
    check.number("num_experts", num_experts, lo=1, integer=True)
    if num_experts % world:
        raise ValueError(f"num_experts={num_experts} must be a multiple of the group's world size {world} "
                         "(experts are placed contiguously, E/W per rank)")
    e_local = num_experts // world
    chunks = _ep_chunks()
    # A rank whose arguments fail the checks still joins the header exchange with an error flag, so
    # the other ranks raise too instead of waiting in the next collective.
    try:
        _check_dispatch(x, ids, num_experts, x_scales, layout, align, max_m)
        bad = None
    except (TypeError, ValueError) as e:
        bad = e
    device = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
    if ep_transport(group) == "peer":
        from ops import moe_ep_peer

        return moe_ep_peer.peer_dispatch(x, ids, num_experts, x_scales, layout, align, max_m, group, bad, device)
    cuda = device.type == "cuda"
    if cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError("moe_dispatch over a process group under CUDA-graph capture needs the peer transport "
                         "(TILECRAFT_EP_TRANSPORT=peer or auto on one host); the a2a transport reads the "
                         "header on the host")
    _mark("start", device)
    # header: this rank's rows per (chunk, global expert) straight from the plan's count kernel,
    # then the tail; all-gathered, so every rank reads what it sends and what it receives on the host
    ce = chunks * num_experts
    tail = [1] + [0] * (_TAIL - 1)
    checking = False
    if bad is None:
        T_, k = ids.shape
        bounds = _token_bounds(T_, chunks)
        checking = _values.enabled(ids)
        tail = [0, x.shape[1] * x.element_size(), 0 if x_scales is None else x_scales.shape[1] * 4,
                int(checking), 0, 0, T_, 0, 0, 0, 0, 0]
    header = (torch.empty if bad is None and T_ else torch.zeros)(ce + _TAIL, dtype=torch.int32, device=device)
    header[ce:].copy_(_tail(tail, device))
    if bad is None and T_:
        place = _ep_send_plan(ids, num_experts, chunks, header[:ce])
        if checking:                                  # read with the header: no extra sync
            torch.aminmax(ids.view(-1), out=(header[ce + 4], header[ce + 5]))
    gathered = torch.empty(world * (ce + _TAIL), dtype=torch.int32, device=device)   # flat: gloo wants it so
    dist.all_gather_into_tensor(gathered, header, group=group)
    gathered = gathered.view(world, ce + _TAIL)
    if cuda:                                                            # read back without waiting for what follows
        host = torch.empty(world, ce + _TAIL, dtype=torch.int32, pin_memory=True)
        host.copy_(gathered, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    _mark("header", device)
    send_x = send_s = None
    if bad is None:
        # work that needs no header: the send order and chunk 0's send rows (under the header's round trip)
        positions, src = place() if T_ else (torch.empty(0, k, dtype=torch.int32, device=device), None)
        send_x = torch.empty(T_ * k, x.shape[1], dtype=x.dtype, device=device)
        send_s = None if x_scales is None else torch.empty(T_ * k, x_scales.shape[1], dtype=torch.float32,
                                                           device=device)

        def send_rows(c):
            a, b = bounds[c], bounds[c + 1]
            if b > a:
                _scatter_into(send_x, x[a:b], positions[a:b], src, pad=False)
                if send_s is not None:
                    _scatter_into(send_s, x_scales[a:b], positions[a:b], src, pad=False)

        send_rows(0)
    _mark("prep", device)
    if cuda:
        ready.synchronize()                                             # the one host sync: split sizes
    else:
        host = gathered
    _mark("synced", device)
    if bad is not None:
        raise bad
    h = host.numpy().astype(np.int64)
    read_header(h, ce, num_experts, me, 0)
    every = h[:, :ce].reshape(world, chunks, world, e_local)            # [source, chunk, destination, expert]
    cnt_send = every[me]                                                # [C, W, El] what this rank sends
    cnt_recv = every[:, :, me]                                          # [W, C, El] what it receives
    send_chunks = cnt_send.sum(2).tolist()                              # [C][W] rows to each rank per chunk
    recv_chunks = cnt_recv.sum(2).T.tolist()                            # [C][W] rows from each rank per chunk
    recv_bounds = [0]
    for c in range(chunks):
        recv_bounds.append(recv_bounds[-1] + sum(recv_chunks[c]))
    recv_x = torch.empty(recv_bounds[-1], x.shape[1], dtype=x.dtype, device=device)
    recv_s = None if x_scales is None else torch.empty(recv_bounds[-1], x_scales.shape[1], dtype=torch.float32,
                                                       device=device)
    works = []
    for c in range(chunks):                                             # same collectives, same order, every rank
        if c:
            send_rows(c)
        a, b, ra, rb = bounds[c] * k, bounds[c + 1] * k, recv_bounds[c], recv_bounds[c + 1]
        works.append(_a2a(recv_x[ra:rb], send_x[a:b], recv_chunks[c], send_chunks[c], group))
        if recv_s is not None:
            works.append(_a2a(recv_s[ra:rb], send_s[a:b], recv_chunks[c], send_chunks[c], group))
    _mark("issued", device)
    lay = _recv_layout(cnt_recv, layout, align, max_m)
    overflow = None
    if layout == "masked" and max_m is not None and checking and lay["busiest"] > max_m:
        overflow = ValueError(f"max_m={max_m} is smaller than the busiest expert's {lay['busiest']} tokens")
    rows = lay["rows"]
    pos, src_rows, counts = _expand_layout(device, lay)
    xd = torch.empty(rows, x.shape[1], dtype=x.dtype, device=device)
    sd = None if x_scales is None else torch.empty(rows, x_scales.shape[1], dtype=torch.float32, device=device)
    if recv_bounds[-1] == 0 and rows:                                   # nothing arrives: every row is padding
        xd.zero_()
        if sd is not None:
            sd.zero_()
    _mark("layout", device)
    zero_pending = lay["pad_rows"] > 0
    per_chunk = 1 if recv_s is None else 2
    for c in range(chunks):
        for w in works[c * per_chunk:(c + 1) * per_chunk]:
            if w is not None:
                w.wait()
        _mark(f"chunk{c}", device)
        ra, rb = recv_bounds[c], recv_bounds[c + 1]
        if rb > ra:                                  # placed while chunk c+1 transfers
            _scatter_into(xd, recv_x[ra:rb], pos[ra:rb], src_rows, pad=zero_pending)
            if sd is not None:
                _scatter_into(sd, recv_s[ra:rb], pos[ra:rb], src_rows, pad=zero_pending)
            zero_pending = False
    _mark("end", device)
    if overflow is not None:                         # after every collective: the peers are not left waiting
        raise overflow
    contiguous = layout == "contiguous"
    mapping = MoeMapping(layout, e_local, 1, pos, counts, m_indices=src_rows if contiguous else None,
                         masked_m=None if contiguous else counts, max_m=lay["max_m"])
    mapping.ep = EpMapping(group, world, me, num_experts, cnt_send.sum((0, 2)).tolist(),
                           cnt_recv.sum((1, 2)).tolist(), positions, chunks, bounds, send_chunks, recv_chunks,
                           recv_bounds)
    if layout == "masked":
        xd = xd.view(e_local, mapping.max_m, x.shape[1])
        sd = sd.view(e_local, mapping.max_m, -1) if sd is not None else None
    return xd, sd, mapping


def ep_combine(y, mapping, weights):
    """Each expert row back to its token's rank, chunk by chunk (the chunks of the dispatch), and the
    combine kernel on a chunk's tokens as soon as their rows are back: the same kernel over the same
    rows in the same order as one device, so the same bits."""
    ep = mapping.ep
    if ep.transport == "peer":
        from ops import moe_ep_peer

        return moe_ep_peer.peer_combine(y, mapping, weights)
    device = y.device
    _mark("start", device)
    H = y.shape[-1]
    y2 = y.reshape(-1, H)
    T_, k = ep.send_positions.shape
    back = torch.empty(ep.recv_bounds[-1], H, dtype=y.dtype, device=device)   # rows in the order they came
    ret = torch.empty(T_ * k, H, dtype=y.dtype, device=device)                 # this rank's rows, send order
    out = torch.empty(T_, H, dtype=y.dtype, device=device)
    src = mapping.positions.view(-1)
    works = []
    for c in range(ep.chunks):
        ra, rb = ep.recv_bounds[c], ep.recv_bounds[c + 1]
        if rb > ra:
            _gather_into(back[ra:rb], y2, src[ra:rb])
        a, b = ep.token_bounds[c] * k, ep.token_bounds[c + 1] * k
        works.append(_a2a(ret[a:b], back[ra:rb], ep.send_chunk_splits[c], ep.recv_chunk_splits[c], ep.group))
    _mark("gather", device)
    combine = combine_launcher(targets.resolve(y), H, k, y.dtype)
    for c in range(ep.chunks):
        if works[c] is not None:
            works[c].wait()
        _mark(f"chunk{c}", device)
        a, b = ep.token_bounds[c], ep.token_bounds[c + 1]
        if b > a:                                    # summed while chunk c+1 returns
            combine(ret, ep.send_positions[a:b], weights[a:b], out[a:b])
    _mark("end", device)
    return out
