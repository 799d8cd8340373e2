"""Expert-parallel dispatch and combine over peer memory (EP transport "peer").

Every rank maps every other rank's buffers of two pools (torch symmetric memory on CUDA: loads and
stores over NVLink or PCIe P2P; on CPU, shared files, so the same code runs under gloo in CI). Rows
then move with one kernel per peer, straight between the user's tensors and their final rows: no
send buffer, no receive buffer, no placement pass, no all-to-all issued per chunk by the host.

dispatch, on rank r:
  1. the send plan over global experts (the single-device count and place kernels, align 1): the
     count goes into the header; the place kernel writes each send row's source token into r's
     slot of the dispatch pool, and x (and its scales) are copied there too (step 2);
  2. the header all-gather (E counts + tail) goes out right after the count kernel; the place
     kernel and the staging follow on the GPU while the host waits for the header alone (the one
     host sync). Every rank stages only after the all-gather, so every rank has finished reading
     the slot it overwrites (its pulls precede its part of the all-gather); a pool barrier after
     the staging makes every rank's staged rows readable;
  3. the local layout from the header (moe_ep_layout, receive order (source rank, expert)), then one
     copy_rows launch per source rank s: xd[pos[i]] = x_s[src_s[off_s + i]], reading s's slot over
     NVLink. s's rows for r are one run of s's send order (sorted by global expert, so by
     destination rank) starting at off_s = the rows s sends to ranks below r.
combine, on rank r:
  1. for each other rank s, one gather launch pushes the rows r's experts computed for s's tokens
     into s's slot of the combine pool, at their place in s's send order;
  2. a barrier of the pool (every rank's pushes are done; it also orders the reuse of the slots);
  3. the combine kernel (its two-source form) over r's slot, reading the rows of r's own experts
     straight from y: the same rows in the same order as one device, so the same bits.
A pool grows collectively (every rank decides the same from the all-gathered header) and is kept
for the next calls, per process group and device. The first call at a new size pays the rendezvous.

Fixed-grid masked dispatch (layout masked with a given max_m, once the pools exist; FIXED_MASKED,
on by default, and always under CUDA-graph capture): steps 2-3 without the host. The
layout tables come from the all-gathered headers on the device, moe_pull_rows reads each source's
count and offsets there on a fixed grid, and every size is a bound the host knows. The header is
read after the pulls are queued (value checks on) or not at all (checks off, as under capture;
every rank must then fit the pools earlier calls sized, else no row moves). Its combine pushes with
moe_push_rows and combines with the tables on the device too (no host read: capturable).
In a CUDA graph a call's pool slot is fixed at capture. A dispatch's slot is safe to reuse at every
replay (its staging follows the header all-gather, which follows every peer's pulls of the last
call); a combine's is safe when a dispatch of the group runs between two replays of it (a decode
step's graph), or when the graph holds an even number of combines.
"""

# no `from __future__ import annotations`: TileLang evaluates T.Tensor annotations itself
import contextlib
import math
import os
import tempfile
import weakref
from types import SimpleNamespace

import numpy as np
import tilelang.language as T
import torch
import torch.distributed as dist

from codegen import jit, targets, tile
from codegen.program import tile_program
from ops import _values
from ops.moe_dispatch import BITS_NAME, EpMapping, MoeMapping, combine_launcher, row_words, zero_padding_macro
from ops import moe_ep
from ops.moe_ep import (_TAIL, _ep_send_plan, _expand_layout, _gather_into, _group_size_rank, _recv_layout, _tail,
                        read_header)

_ALIGN = 256          # byte alignment of every region inside a pool slot
MIN_SLOT_BYTES = 1 << 20   # a pool slot's smallest size (pools grow by powers of two from there)


@tile_program("moe_copy_rows", targets=("cuda:sm_90a", "cuda:sm_100a", "ascend:950", "cpu"),
              examples={"h7168-bf16": dict(hidden=7168, bits="int16"),
                        "h7168-bf16-pad": dict(hidden=7168, bits="int16", pad=True)})
def copy_rows_program(hidden: int, bits: str = "int16", pad: bool = False, threads: int = 128,
                      zero_rows: int = 8):
    """Y[Dst[i], :] = X[Src[i], :] for i < n, on raw bits (X may be a peer's buffer); with pad, also
    Y[r, :] = 0 where Valid[r] < 0 (blocks past n, zero_rows rows each)."""
    n, tokens, rows = T.dynamic("n, tokens, rows")
    extra = T.ceildiv(rows, zero_rows) if pad else 0
    zero_padding = zero_padding_macro(hidden, bits, zero_rows)

    @T.prim_func
    def copy_rows(X: T.Tensor((tokens, hidden), bits), Src: T.Tensor((n,), "int32"), Dst: T.Tensor((n,), "int32"),
                  Valid: T.Tensor((rows,), "int32"), Y: T.Tensor((rows, hidden), bits)):
        with tile.grid(n + extra, threads) as b:
            with tile.vector():
                if b < n:
                    for c in tile.parallel(hidden):
                        Y[Dst[b], c] = X[Src[b], c]
                else:
                    zero_padding(Y, Valid, b - n, rows)

    return copy_rows


PULL_BLOCKS = 1024   # the fixed grid of moe_pull_rows (its row count is read on the device)


@tile_program("moe_pull_rows", targets=("cuda:sm_90a", "cuda:sm_100a", "ascend:950", "cpu"),
              examples={"h7168-bf16": dict(hidden=7168, bits="int16"),
                        "h7168-bf16-pad": dict(hidden=7168, bits="int16", pad=True)})
def pull_rows_program(hidden: int, bits: str = "int16", pad: bool = False, blocks: int = PULL_BLOCKS,
                      threads: int = 128, zero_rows: int = 8):
    """Y[Pos[Info[2] + i], :] = X[Src[Info[1] + i], :] for i < Info[0]: the rows one source rank
    sends this rank, out of that rank's dispatch slot (X its rows, Src its send rows' source tokens).
    The count and both offsets are read on the device, so the launch needs no host read: `blocks`
    blocks step over the rows. pad: extra blocks zero the rows r of Y with Valid[r] < 0."""
    tokens, nsrc, npos, rows = T.dynamic("tokens, nsrc, npos, rows")
    extra = T.ceildiv(rows, zero_rows) if pad else 0
    zero_padding = zero_padding_macro(hidden, bits, zero_rows)

    @T.prim_func
    def pull_rows(X: T.Tensor((tokens, hidden), bits), Src: T.Tensor((nsrc,), "int32"), Info: T.Tensor((4,), "int32"),
                  Pos: T.Tensor((npos,), "int32"), Valid: T.Tensor((rows,), "int32"), Y: T.Tensor((rows, hidden), bits)):
        with tile.grid(blocks + extra, threads) as b:
            with tile.vector():
                if b < blocks:
                    for it in T.serial(T.ceildiv(T.max(Info[0] - b, 0), blocks)):
                        for c in tile.parallel(hidden):
                            Y[Pos[Info[2] + b + it * blocks], c] = X[Src[Info[1] + b + it * blocks], c]
                else:
                    zero_padding(Y, Valid, b - blocks, rows)

    return pull_rows


@tile_program("moe_push_rows", targets=("cuda:sm_90a", "cuda:sm_100a", "ascend:950", "cpu"),
              examples={"h7168-bf16": dict(hidden=7168, bits="int16")})
def push_rows_program(hidden: int, bits: str = "int16", blocks: int = PULL_BLOCKS, threads: int = 128):
    """Y[Info[1] + i, :] = X[Pos[Info[2] + i], :] for i < Info[0]: moe_pull_rows the other way, for
    the combine after a fixed-grid dispatch (X this rank's expert outputs, Y a peer's combine slot,
    Info that peer's row of the dispatch's info table): the rows come back to where the peer's send
    order has them, and the count and offsets are read on the device."""
    rows, npos, slot_rows = T.dynamic("rows, npos, slot_rows")

    @T.prim_func
    def push_rows(X: T.Tensor((rows, hidden), bits), Info: T.Tensor((4,), "int32"), Pos: T.Tensor((npos,), "int32"),
                  Y: T.Tensor((slot_rows, hidden), bits)):
        with tile.grid(blocks, threads) as b:
            with tile.vector():
                for it in T.serial(T.ceildiv(T.max(Info[0] - b, 0), blocks)):
                    for c in tile.parallel(hidden):
                        Y[Info[1] + b + it * blocks, c] = X[Pos[Info[2] + b + it * blocks], c]

    return push_rows


def _pull_rows(y, x, src, info, pos, valid, pad):
    """pull_rows_program on raw bits (x: a source rank's rows, src its source tokens, info (4,))."""
    target = targets.resolve(y)
    xw = x.view(row_words(x, target))
    hidden, bits = xw.shape[1], xw.dtype
    pull = jit.launchers(("moe_pull_rows", target.name, hidden, bits, pad), lambda: (
        pull_rows_program.compile(target, hidden=hidden, bits=BITS_NAME[bits], pad=pad).launcher()))
    pull(xw, src, info, pos, valid, y.view(bits))


def _push_rows(y, x, info, pos):
    """push_rows_program on raw bits (y: a peer's combine slot, x: this rank's expert rows)."""
    target = targets.resolve(y)
    xw = x.view(row_words(x, target))
    hidden, bits = xw.shape[1], xw.dtype
    push = jit.launchers(("moe_push_rows", target.name, hidden, bits), lambda: (
        push_rows_program.compile(target, hidden=hidden, bits=BITS_NAME[bits]).launcher()))
    push(xw, info, pos, y.view(bits))


def _copy_rows(y, x, src, dst, valid, pad):
    """y[dst[i]] = x[src[i]] (rows, raw bits), and with pad zeros on the rows where valid < 0."""
    target = targets.resolve(y)
    xw = x.view(row_words(x, target))
    hidden, bits = xw.shape[1], xw.dtype
    copy = jit.launchers(("moe_copy_rows", target.name, hidden, bits, pad), lambda: (
        copy_rows_program.compile(target, hidden=hidden, bits=BITS_NAME[bits], pad=pad).launcher()))
    copy(xw, src, dst, valid, y.view(bits))


class PeerPool:
    """Two slots of slot_bytes on every rank of a group, each rank's mapped in every rank:
    view(rank, slot, offset, shape, dtype) is a tensor over that rank's memory. CUDA: torch symmetric
    memory (one rendezvous); CPU: one shared file per rank, mapped by all (gloo tests)."""

    def __init__(self, group, device, slot_bytes):
        self.slot_bytes = slot_bytes              # (no reference to group: a pool must not keep a process group alive)
        world, me = dist.get_world_size(group), dist.get_rank(group)
        nbytes = 2 * slot_bytes
        self._handle, self._views = None, {}
        if device.type == "cuda":
            from torch._C._distributed_c10d import _SymmetricMemory
            from torch.distributed import _symmetric_memory as symm

            # a block of its own, not symm.empty's pool: a tensor carved from a pooled block that was
            # already rendezvoused skips the collective on that rank only (the peers would hang)
            local = _SymmetricMemory.empty_strided_p2p((nbytes,), (1,), torch.uint8, device)
            self._handle = symm.rendezvous(local, group)
            self._bufs = [local if r == me else self._handle.get_buffer(r, (nbytes,), torch.uint8, 0)
                          for r in range(world)]
        else:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            fd, path = tempfile.mkstemp(prefix="tilecraft-ep-", dir=folder)
            os.close(fd)
            local = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            paths = [None] * world
            dist.all_gather_object(paths, path, group=group)
            self._bufs = [local if r == me else torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8)
                          for r, p in enumerate(paths)]
            dist.barrier(group=group)                  # every rank has mapped every file
            os.unlink(path)

    def view(self, rank, slot, offset, shape, dtype):
        key = (rank, slot, offset, shape, dtype)
        v = self._views.get(key)
        if v is None:                                  # (three view ops: ~30 us of host time on an H200 host)
            if len(self._views) >= 4096:
                self._views.clear()
            v = self._views[key] = self._view(rank, slot, offset, shape, dtype)
        return v

    def _view(self, rank, slot, offset, shape, dtype):
        start = slot * self.slot_bytes + offset
        nbytes = math.prod(shape) * dtype.itemsize
        if offset % _ALIGN or offset + nbytes > self.slot_bytes:
            raise AssertionError(f"pool view [{offset}, {offset + nbytes}) outside a {self.slot_bytes}-byte slot")
        return self._bufs[rank][start:start + nbytes].view(dtype).view(shape)

    def barrier(self, group):
        """Every rank reached this point of its stream (CUDA: a device barrier on the signal pads)."""
        if self._handle is not None:
            self._handle.barrier(channel=0)
        else:
            dist.barrier(group=group)


# (group name, device, "dispatch" | "combine") -> [weakref to the group, PeerPool or None, calls so far]
# (the slot is calls % 2, the same on every rank). A group made after destroy_process_group may
# reuse an old group's name: the weak reference tells them apart without keeping either alive.
_STATE = {}


def _key(group, device, purpose):
    key = (getattr(group, "group_name", id(group)), str(device), purpose)
    st = _STATE.get(key)
    if st is None or st[0]() is not group:
        _STATE[key] = [weakref.ref(group), None, 0]
    return key


def _next_slot(key):
    st = _STATE[key]
    st[2] += 1
    return (st[2] - 1) % 2


def _pool(key):
    return _STATE[key][1]


def _grow(key, group, device, need):
    """The pool of key with a slot of at least need bytes (a collective when it grows: every rank
    makes the same call, from numbers every rank has)."""
    pool = _STATE[key][1]
    if pool is None or pool.slot_bytes < need:
        if pool is not None and device.type == "cuda":
            torch.cuda.synchronize(device)            # nothing may still read or write the old pool
        size = max(MIN_SLOT_BYTES, 1 << (max(need, 1) - 1).bit_length())
        _STATE[key][1] = None
        pool = _STATE[key][1] = PeerPool(group, device, size)
    return pool


def _up(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _slot_layout(slot_bytes, row_x, row_s):
    """A dispatch slot's regions, the same on every rank (no token count in them: a peer finds
    another rank's rows without knowing how many it staged): the first half holds x rows, then
    scale rows; the second half the send rows' source tokens. Returns (token capacity, scales'
    byte offset, source tokens' byte offset, source-token capacity)."""
    half = slot_bytes // 2 // _ALIGN * _ALIGN
    tokens = max(half - _ALIGN, 0) // (row_x + row_s)
    return tokens, _up(tokens * row_x), half, (slot_bytes - half) // 4


def _slot_need(tokens, rows, row_x, row_s):
    """Slot bytes for `tokens` x rows (and scales) and `rows` source tokens in _slot_layout."""
    return 2 * max(tokens * (row_x + row_s) + 2 * _ALIGN, rows * 4 + _ALIGN)


def _fits(pool, tokens, rows, row_x, row_s):
    if pool is None:
        return False
    cap_t, _, _, cap_src = _slot_layout(pool.slot_bytes, row_x, row_s)
    return tokens <= cap_t and rows <= cap_src


def peer_dispatch(x, ids, num_experts, x_scales, layout, align, max_m, group, bad, device):
    """ep_dispatch over peer memory (module docstring). bad: this rank's argument error, raised after
    the header exchange so that the other ranks raise too. With FIXED_MASKED, a masked dispatch with
    a given max_m takes the fixed-grid path once the pool exists (every rank decides alike: the same
    settings, the same pool history)."""
    key = _key(group, device, "dispatch")
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if (FIXED_MASKED or capturing) and layout == "masked" and max_m is not None and _pool(key) is not None:
        return _dispatch_fixed(x, ids, num_experts, x_scales, align, max_m, group, bad, device, key)
    if capturing:
        raise ValueError("moe_dispatch over a process group under CUDA-graph capture needs layout='masked' with "
                         "max_m given, and one call outside the graph first (it sizes the peer-memory pools; "
                         f"got layout={layout!r}, max_m={max_m}, pools {'ready' if _pool(key) else 'not made yet'})")
    return _dispatch_synced(x, ids, num_experts, x_scales, layout, align, max_m, group, bad, device, key)


def _exchange_and_stage(x, ids, num_experts, x_scales, group, bad, device, key, read_back):
    """Steps 1-2 of both peer dispatches: the send plan's count into the header, the header
    all-gather, then (under the exchange) the place kernel writing the source tokens into this
    rank's slot and the staging of x, when the slot fits this call (mode 2 in the header; else
    mode 1 and the source tokens stay in the plan's own buffer). read_back: True, or None for "when
    value checks are on": the all-gathered header is copied to pinned memory behind an event, so
    .read() waits for the header alone. Returns a namespace of what the callers go on with."""
    world, me = _group_size_rank(group)
    slot, pool = _next_slot(key), _pool(key)
    moe_ep._mark("start", device)
    tail = [1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]
    checking = staged = False
    T_ = k = row_x = row_s = 0
    if bad is None:
        T_, k = ids.shape
        row_x, row_s = x.shape[1] * x.element_size(), 0 if x_scales is None else x_scales.shape[1] * 4
        staged = _fits(pool, T_, T_ * k, row_x, row_s)
        checking = _values.enabled(ids)
        tail = [0, row_x, row_s, int(checking), k, 0, T_, 1 + int(staged), 0, 0, 0, 0]   # [4]: top_k
    header = (torch.empty if bad is None and T_ else torch.zeros)(num_experts + _TAIL, dtype=torch.int32,
                                                                   device=device)
    header[num_experts:].copy_(_tail(tail, device))          # (the count kernel then writes its stats)
    place = _ep_send_plan(ids, num_experts, 1, header[:num_experts], header[num_experts + 8:]) \
        if bad is None and T_ else None
    gathered = torch.empty(world * (num_experts + _TAIL), dtype=torch.int32, device=device)
    dist.all_gather_into_tensor(gathered, header, group=group)
    host = ready = None
    if device.type == "cuda" and (checking if read_back is None else read_back):
        host = torch.empty(world, num_experts + _TAIL, dtype=torch.int32, pin_memory=True)
        host.copy_(gathered.view(world, -1), non_blocking=True)  # without waiting for what follows
        ready = torch.cuda.Event()
        ready.record()
    moe_ep._mark("header", device)
    positions = torch.empty(0, max(k, 1), dtype=torch.int32, device=device)
    src = torch.empty(0, dtype=torch.int32, device=device)
    if bad is None and T_:                   # the GPU places and stages while the host reads the header
        positions, src = place(_src_view(pool, me, slot, row_x, row_s, T_ * k) if staged else None)
        if staged:
            _stage(pool, me, slot, x, x_scales, None)
    moe_ep._mark("staged", device)

    def read():
        if ready is not None:
            ready.synchronize()
        return (host if host is not None else gathered.view(world, -1)).numpy().astype(np.int64)

    return SimpleNamespace(world=world, me=me, slot=slot, pool=pool, tokens=T_, top_k=k, row_x=row_x, row_s=row_s,
                           checking=checking, gathered=gathered, positions=positions, src=src, read=read)


_SIDE_STREAMS = {}


def _each_source(device, world, me, pull, pad):
    """pull(s, pad) -> whether it moved rows, for every source rank s; the first launch that moves
    rows gets pad (it also zeroes the padding rows). This rank's own rows go first, on CUDA on a
    side stream: that HBM copy runs beside the peers' pulls over NVLink on the current stream
    (joined before returning; capturable, a fork and join of the graph)."""
    side = cur = None
    if device.type == "cuda" and world > 1:
        side = _SIDE_STREAMS.get(str(device))
        if side is None:
            side = _SIDE_STREAMS[str(device)] = torch.cuda.Stream(device)
        cur = torch.cuda.current_stream(device)
        side.wait_stream(cur)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        if pull(me, pad):
            pad = False
    for step in range(1, world):
        if pull((me + step) % world, pad):
            pad = False
    if side is not None:
        cur.wait_stream(side)


def _dispatch_synced(x, ids, num_experts, x_scales, layout, align, max_m, group, bad, device, key):
    """The dispatch whose layout is computed on the host, from the header read before any row moves."""
    st = _exchange_and_stage(x, ids, num_experts, x_scales, group, bad, device, key, read_back=True)
    world, me, slot, pool, T_ = st.world, st.me, st.slot, st.pool, st.tokens
    row_x, row_s, checking, positions, src = st.row_x, st.row_s, st.checking, st.positions, st.src
    e_local = num_experts // world
    H = x.shape[1] if bad is None else 1
    h = st.read()                            # the one host sync: the header only
    moe_ep._mark("synced", device)
    if bad is not None:
        raise bad
    tails = read_header(h, num_experts, num_experts, me, 1)
    every = h[:, :num_experts].reshape(world, world, e_local)          # [source, destination, expert]
    send_rows = every.sum((1, 2))                                       # T*k of every rank
    tokens = tails[:, 6]
    if (tails[:, 7] == 1).any():                                        # some rank could not stage: grow, restage
        need = _slot_need(int(tokens.max()), int(send_rows.max()), row_x, row_s)
        old_src = src
        pool = _grow(key, group, device, need)
        _stage(pool, me, slot, x, x_scales, old_src)
    pool.barrier(group)                      # every rank's x rows and source tokens are staged
    cnt_recv = every[:, me]                                             # [W, El] rows from each source rank
    recv = cnt_recv.sum(1)
    offsets = every[:, :me].sum((1, 2))                                 # my run's start in each rank's send order
    lay = _recv_layout(cnt_recv[:, None, :], layout, align, max_m)
    overflow = None
    if layout == "masked" and max_m is not None and checking and lay["busiest"] > max_m:
        overflow = ValueError(f"max_m={max_m} is smaller than the busiest expert's {lay['busiest']} tokens")
    rows = lay["rows"]
    pos, valid, counts = _expand_layout(device, lay)
    xd = torch.empty(rows, H, dtype=x.dtype, device=device)
    sd = None if x_scales is None else torch.empty(rows, x_scales.shape[1], dtype=torch.float32, device=device)
    moe_ep._mark("layout", device)
    pad = lay["pad_rows"] > 0
    if lay["n"] == 0 and rows:                                          # nothing arrives: every row is padding
        xd.zero_()
        if sd is not None:
            sd.zero_()
    bounds = np.concatenate([[0], np.cumsum(recv)])
    dst_all = pos.view(-1)
    def pull(s, pad):
        n = int(recv[s])
        if n == 0:
            return False
        t_s, n_s = int(tokens[s]), int(send_rows[s])
        src_s = _src_view(pool, s, slot, row_x, row_s, n_s)[int(offsets[s]):int(offsets[s]) + n]
        dst = dst_all[int(bounds[s]):int(bounds[s]) + n]
        _copy_rows(xd, pool.view(s, slot, 0, (t_s, H), x.dtype), src_s, dst, valid, pad)
        if sd is not None:
            _copy_rows(sd, _scales_view(pool, s, slot, row_x, row_s, t_s), src_s, dst, valid, pad)
        return True

    _each_source(device, world, me, pull, pad)
    moe_ep._mark("end", device)
    if overflow is not None:                         # after every exchange: the peers are not left waiting
        raise overflow
    contiguous = layout == "contiguous"
    mapping = MoeMapping(layout, e_local, 1, pos, counts, m_indices=valid if contiguous else None,
                         masked_m=None if contiguous else counts, max_m=lay["max_m"])
    send = every[me].sum(1).tolist()
    mapping.ep = EpMapping(group, world, me, num_experts, send, recv.tolist(), positions, 1, [0, T_], [send],
                           [recv.tolist()], [0, int(recv.sum())], transport="peer",
                           send_rows=send_rows.tolist(), peer_offsets=offsets.tolist())
    if layout == "masked":
        xd = xd.view(e_local, mapping.max_m, H)
        sd = sd.view(e_local, mapping.max_m, -1) if sd is not None else None
    return xd, sd, mapping


# the fixed-grid path for eager calls too (the same on every rank; always taken under CUDA-graph
# capture): a masked dispatch with a given max_m reads nothing on the host before its rows move,
# and nothing at all with value checks off (bench/NOTES.md "EP v5", "EP v6"). False: the synced path.
FIXED_MASKED = True
_FIXED_TABLES = {}


def _fixed_constants(world, e_local, max_m, device):
    """Per (W, El, max_m, device): each expert's first row (e * max_m) for the segment and expert
    tables, kept (two small ops fewer per call)."""
    key = (world, e_local, max_m, str(device))
    t = _FIXED_TABLES.get(key)
    if t is None:                            # never dropped: CUDA graphs captured with them read them
        first = torch.arange(e_local, dtype=torch.int32, device=device) * max_m
        t = _FIXED_TABLES[key] = (first, first.repeat(world), torch.full((e_local,), max_m, dtype=torch.int32,
                                                                         device=device))
    return t


def _fixed_tables(gathered, num_experts, world, me, max_m, device):
    """From the all-gathered headers, on the device (no host read): info (W, 4) int32 per source rank
    [rows it sends this rank, where they start in its send order, where in the receive order, 0],
    the segment and expert tables of moe_ep_layout, the expert counts, and a flag: 1 when every
    rank staged its rows and none reported bad arguments or another row size (else every count is
    zeroed: nothing moves, and the host read, when there is one, redoes or raises)."""
    e_local = num_experts // world
    g = gathered.view(world, num_experts + _TAIL)
    tails = g[:, num_experts:]
    # staged, good arguments, and one row size and top_k everywhere (tail [1:3] and [4])
    ok = (tails[:, 7] == 2) & (tails[:, 0] == 0) & (tails[:, 1:5] == tails[:1, 1:5]).all(1)
    flag = ok.all().to(torch.int32)
    cnt = g[:, :num_experts].view(world, world, e_local)                # [source, destination, expert]
    c = cnt[:, me] * flag                                               # [W, El] rows to my experts
    n = c.sum(1, dtype=torch.int32)
    info = torch.stack([n, cnt[:, :me].sum((1, 2), dtype=torch.int32), n.cumsum(0, dtype=torch.int32) - n,
                        torch.zeros_like(n)], 1)
    flat = c.reshape(-1)
    first, first_w, width = _fixed_constants(world, e_local, max_m, device)
    seg = torch.stack([flat.cumsum(0, dtype=torch.int32) - flat, flat, first_w,
                       (c.cumsum(0, dtype=torch.int32) - c).reshape(-1)], 1)
    counts = c.sum(0, dtype=torch.int32)
    exp = torch.stack([first, counts, width, torch.zeros_like(counts)], 1)
    return info, seg.contiguous(), exp.contiguous(), counts


_TABLE_GRAPHS = {}


def _tables(gathered, num_experts, world, me, max_m, device):
    """_fixed_tables, eager on CUDA as one replay of a CUDA graph of its ~20 small ops (kept per
    shape: 2 copies and a replay of host time instead of ~20 launches, ~0.4 ms on the H200 host);
    under capture, and on CPU, the ops themselves."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return _fixed_tables(gathered, num_experts, world, me, max_m, device)
    key = (num_experts, world, me, max_m, str(device))
    entry = _TABLE_GRAPHS.get(key)
    if entry is None:
        static_in = gathered.clone()         # (one graph per shape and rank; never dropped, as the constants)
        side = torch.cuda.Stream(device)                   # capture wants a warm-up off the current stream
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            _fixed_tables(static_in, num_experts, world, me, max_m, device)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):   # (NCCL's threads run on)
            static_out = _fixed_tables(static_in, num_experts, world, me, max_m, device)
        entry = _TABLE_GRAPHS[key] = (graph, static_in, static_out)
    graph, static_in, (info, seg, exp, counts) = entry
    static_in.copy_(gathered)
    graph.replay()
    # seg and exp are read by the next launch only; info and counts stay with the mapping
    return info.clone(), seg, exp, counts.clone()


def _dispatch_fixed(x, ids, num_experts, x_scales, align, max_m, group, bad, device, key):
    """Masked dispatch with a given max_m whose row movement needs no host read: the layout tables
    come from the all-gathered headers on the device (_fixed_tables), the pulls read their counts
    there (moe_pull_rows), and every size is a bound the host knows (the output is (E/W, max_m, H);
    the receive order is bounded by the pool). With value checks on, the header is read after the
    pulls are queued: errors are raised then, and a call some rank could not stage (its pool slot
    too small) is done again by the synced path, which grows the pools. With checks off nothing is
    read: every rank must fit the pools earlier calls sized (else that call moves no rows)."""
    st = _exchange_and_stage(x, ids, num_experts, x_scales, group, bad, device, key, read_back=None)
    world, me, slot, pool, T_, k = st.world, st.me, st.slot, st.pool, st.tokens, st.top_k
    row_x, row_s, checking, positions, gathered = st.row_x, st.row_s, st.checking, st.positions, st.gathered
    e_local = num_experts // world
    pool.barrier(group)                      # every rank's rows and source tokens are staged
    info, seg, exp, counts = _tables(gathered, num_experts, world, me, max_m, device)
    # the sizes are bounds the host knows: every row any rank may send me (a slot's tokens x top_k,
    # the same top_k everywhere, or the flag stopped every row)
    H = x.shape[1] if bad is None else 1
    row_x_all, row_s_all = (row_x, row_s) if bad is None else (1, 0)
    cap_t, _, _, cap_src = _slot_layout(pool.slot_bytes, row_x_all, row_s_all)
    pos = torch.empty(world * max(1, min(cap_t * k, cap_src)), dtype=torch.int32, device=device)
    valid = torch.empty(e_local * max_m, dtype=torch.int32, device=device)
    target = targets.resolve(pos)
    expand = jit.launchers(("moe_ep_layout", target.name), lambda: moe_ep.ep_layout_program.compile(target).launcher())
    expand(seg, exp, max_m - 1, pos, valid)
    xd = sd = None
    if bad is None:
        xd = torch.empty(e_local * max_m, H, dtype=x.dtype, device=device)
        sd = None if x_scales is None else torch.empty(e_local * max_m, x_scales.shape[1], dtype=torch.float32,
                                                       device=device)

        def pull(s, pad):
            src_s = _src_view(pool, s, slot, row_x, row_s, cap_src)
            _pull_rows(xd, pool.view(s, slot, 0, (cap_t, H), x.dtype), src_s, info[s], pos, valid, pad)
            if sd is not None:
                _pull_rows(sd, _scales_view(pool, s, slot, row_x, row_s, cap_t), src_s, info[s], pos, valid, pad)
            return True

        _each_source(device, world, me, pull, True)
    moe_ep._mark("end", device)
    ep = None
    if checking:                             # the deferred read (as on the GPU, none with checks off)
        h = st.read()
        if bad is not None:
            raise bad
        tails = read_header(h, num_experts, num_experts, me, 1)
        if (tails[:, 7] == 1).any():         # some rank could not stage: the synced path grows the pools
            return _dispatch_synced(x, ids, num_experts, x_scales, "masked", align, max_m, group, None, device, key)
        busiest = int(h[:, me * e_local:(me + 1) * e_local].sum(0).max(initial=0))
        if checking and busiest > max_m:
            raise ValueError(f"max_m={max_m} is smaller than the busiest expert's {busiest} tokens")
        ep = _host_lists(h, num_experts, world, me)
    if bad is not None:
        raise bad
    mapping = MoeMapping("masked", e_local, 1, pos.view(-1, 1), counts, m_indices=None, masked_m=counts, max_m=max_m)
    mapping.ep = EpMapping(group, world, me, num_experts, None, None, positions, 1, [0, T_], None, None, None,
                           transport="peer", header=gathered.view(world, -1), info=info)
    if ep is not None:
        _fill_host_lists(mapping.ep, ep)
    xd = xd.view(e_local, max_m, H)
    sd = sd.view(e_local, max_m, -1) if sd is not None else None
    return xd, sd, mapping


def _host_lists(h, num_experts, world, me):
    """The host lists of an EpMapping (rows per rank and offsets) from the headers (W, E + _TAIL)."""
    e_local = num_experts // world
    every = h[:, :num_experts].reshape(world, world, e_local)
    send, recv = every[me].sum(1), every[:, me].sum(1)
    return dict(send_splits=send.tolist(), recv_splits=recv.tolist(), send_chunk_splits=[send.tolist()],
                recv_chunk_splits=[recv.tolist()], recv_bounds=[0, int(recv.sum())],
                send_rows=every.sum((1, 2)).tolist(), peer_offsets=every[:, :me].sum((1, 2)).tolist())


def _fill_host_lists(ep, lists):
    for name, value in lists.items():
        setattr(ep, name, value)


def _src_view(pool, rank, slot, row_x, row_s, rows):
    """The first `rows` source tokens of rank's dispatch slot."""
    return pool.view(rank, slot, _slot_layout(pool.slot_bytes, row_x, row_s)[2], (rows,), torch.int32)


def _scales_view(pool, rank, slot, row_x, row_s, tokens):
    """The first `tokens` scale rows (row_s bytes of fp32) of rank's dispatch slot."""
    return pool.view(rank, slot, _slot_layout(pool.slot_bytes, row_x, row_s)[1], (tokens, row_s // 4), torch.float32)


def _stage(pool, me, slot, x, x_scales, src):
    """This rank's x rows (and scales) into its dispatch slot, and its send rows' source tokens when
    they were placed elsewhere (src not None)."""
    T_, row_x = x.shape[0], x.shape[1] * x.element_size()
    row_s = 0 if x_scales is None else x_scales.shape[1] * 4
    if T_:
        pool.view(me, slot, 0, tuple(x.shape), x.dtype).copy_(x)
        if x_scales is not None:
            _scales_view(pool, me, slot, row_x, row_s, T_).copy_(x_scales)
    if src is not None and src.numel():
        _src_view(pool, me, slot, row_x, row_s, src.numel()).copy_(src)


def peer_combine(y, mapping, weights):
    """ep_combine over peer memory (module docstring): push, barrier, the single-device combine.
    After a fixed-grid dispatch (mapping.ep.info set) the pushes (moe_push_rows) and the two-source
    combine read their counts and offsets from that dispatch's info table on the device, so no host
    read is needed (capturable); else they take the host lists."""
    ep = mapping.ep
    device = y.device
    group, world, me = ep.group, ep.world_size, ep.rank
    key = _key(group, device, "combine")
    slot = _next_slot(key)
    H = y.shape[-1]
    row = H * y.element_size()
    T_, k = ep.send_positions.shape
    pool, info = _combine_pool(ep, key, row, k, device)
    moe_ep._mark("start", device)
    y2 = y.reshape(-1, H)
    pos = mapping.positions.view(-1)
    bounds = None if info is not None else np.concatenate([[0], np.cumsum(ep.recv_splits)])
    slot_rows = pool.slot_bytes // row
    for step in range(1, world):                                        # the peers' rows only
        s = (me + step) % world
        if info is not None:
            _push_rows(pool.view(s, slot, 0, (slot_rows, H), y.dtype), y2, info[s], pos)
        elif ep.recv_splits[s]:                                         # rows [off, off + n) of s's send order
            n, off = ep.recv_splits[s], ep.peer_offsets[s]
            _gather_into(pool.view(s, slot, 0, (off + n, H), y.dtype)[off:], y2, pos[int(bounds[s]):int(bounds[s]) + n])
    moe_ep._mark("push", device)
    pool.barrier(group)
    moe_ep._mark("barrier", device)
    out = torch.empty(T_, H, dtype=y.dtype, device=device)
    if T_:
        # my own experts' rows stay in y: rows [lo, lo + nloc) of my send order are y's rows loc
        ret = pool.view(me, slot, 0, (min(T_ * k, slot_rows), H), y.dtype)
        if info is not None:
            combine_launcher(targets.resolve(y), H, k, y.dtype, split="info")(
                ret, ep.send_positions, weights, out, y2, pos, info[me])
        else:
            lo, nloc = ep.peer_offsets[me], ep.recv_splits[me]
            loc = pos[int(bounds[me]):int(bounds[me]) + nloc] if nloc else ep.send_positions.view(-1)[:1]
            combine_launcher(targets.resolve(y), H, k, y.dtype, split=True)(
                ret, ep.send_positions, weights, out, y2 if nloc else ret, loc, lo, nloc)
    moe_ep._mark("end", device)
    return out


def _combine_pool(ep, key, row, k, device):
    """(the combine pool, the info table to use or None for the host lists). The pool is sized from
    the host lists (every rank: the same numbers); after a fixed-grid dispatch made with value
    checks off they are read from its header here, except under capture, where the pool must exist
    and every rank checks on the device that every rank's rows fit it (else no row moves and the
    output is undefined: the unchecked contract of the fixed-grid dispatch; nothing is written out
    of bounds)."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if ep.send_rows is None and not capturing:
        _fill_host_lists(ep, _host_lists(ep.header.cpu().numpy().astype(np.int64), ep.num_experts, ep.world_size,
                                         ep.rank))
    if ep.send_rows is not None:
        return _grow(key, ep.group, device, _up(max(ep.send_rows) * row)), ep.info
    pool = _pool(key)
    if pool is None:
        raise ValueError("moe_combine under CUDA-graph capture needs one combine outside the graph first "
                         "(it sizes the peer-memory pool)")
    tokens = ep.header[:, ep.num_experts + 6]                           # every rank's T (header tail [6])
    return pool, ep.info * (tokens * k <= pool.slot_bytes // row).all().to(torch.int32)
