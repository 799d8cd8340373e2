"""Where a step of the sm_90a MLA pipeline goes: SM clock stamps of CTA 0, per warpgroup event.

    python -m bench.trace_mla            # h_q=16 (bf16, FP8 and its stage_raw / rope_direct / fold_scales options),
                                         # h_q=128 (bf16, and FP8 with two converters)
    python -m bench.trace_mla fp8-16 fp8-16-unfolded   # only the named cases (names: see CASES)
    ncu --profile-from-start off -k regex:mla_decode --section SpeedOfLight --section WarpStateStats \
        python -m bench.trace_mla --ncu bf16-128-seesaw   # one untraced run of each case, for a profiler

Builds mla_decode with trace=True (lowering/sm90_attention.py writes the stamps of CTA 0, and of
CTA 1, its sibling 64-row tile of the same sequence, when there are two, into the unsplit
run's unused partials buffer) and prints, for steps 20-27, each event relative to the step's start;
then every CTA's timeline (global timer and SM clock when its warpgroups start and when WG0's
epilogue is done): the kernel's span, CTA durations, the SM clock they ran at, and how busy the
SMs were. The trace builds are diagnostic: the timeline's stamps may spill a few registers
outside the loop (h_q = 128 default: 8 bytes).
"""
import sys

import torch

import ops
from bench.suites.mla import FP8_TWO_CONVERTERS, PRESETS, make_inputs
from codegen.lowering.sm90_attention import EVENTS, TIMELINE_COL, TIMELINE_PER_ROW
from ops.mla_decode import D_QK, D_V, FP8_FOLD, LOG2E, _mla_decode_impl, get_mla_schedule, mla_decode_program, pick_tiling


def main() -> int:
    if not torch.cuda.is_available():
        print("bench.trace_mla needs a CUDA GPU (sm_90a): none found", file=sys.stderr)
        return 2
    direct128 = {k: v for k, v in pick_tiling(128, "bf16", "sm_90a", 64).items() if k != "stage_out"}
    swapped_fp8 = FP8_FOLD          # (the op's FP8 kernel at 16 rows is ops.mla_decode_fp8_rs: bench.trace_mla_rs)
    # decode rows: b=128 h_q=16 8192 (the op's tilings; the swapped FP8 kernel with stage_raw, without
    # rope_direct, without fold_scales), b=128 h_q=128 4096
    cases = {"bf16-16": (1, "bf16", None), "fp8-16": (1, "fp8", FP8_FOLD),
             "fp8-16-staged": (1, "fp8", dict(swapped_fp8, stage_raw=True, fold_scales=False)),
             "fp8-16-raw-rope": (1, "fp8", dict(swapped_fp8, rope_direct=False)),
             "fp8-16-unfolded": (1, "fp8", dict(swapped_fp8, fold_scales=False)),
             "bf16-128": (4, "bf16", None), "fp8-128-two": (4, "fp8", FP8_TWO_CONVERTERS),
             # seesaw: a stamp per pair of steps (WG0 scores the first, WG1 the second)
             "bf16-128-seesaw": (4, "bf16", dict(block_n=64, stages=2, seesaw=True)),
             # persistent: CTA 0's two units back to back, a stamp per pair across both (pairs 32+: unit 2);
             # the op's build at 128 rows (lazy rescaling, splits dealt whole: no merge; the output staged in the
             # query tiles, the next unit's query loaded after the epilogue)
             "bf16-128-persistent": (4, "bf16", pick_tiling(128, "bf16", "sm_90a", 64)),
             # ... with the accumulator stored directly (4 bytes of 8 rows a warp instruction), the next query
             # loaded under the epilogue (the op before session 79)
             "bf16-128-persistent-direct": (4, "bf16", direct128),
             # ... the op's, with the next unit's first steps issued before its query (kv_first)
             "bf16-128-persistent-kvfirst": (4, "bf16", dict(pick_tiling(128, "bf16", "sm_90a", 64), kv_first=True)),
             # ... the op's, with the staged output out by TMA stores (out_tma)
             "bf16-128-persistent-outtma": (4, "bf16", dict(pick_tiling(128, "bf16", "sm_90a", 64), out_tma=True)),
             # ... and that query loaded once the last scores are done (early_q)
             "bf16-128-persistent-earlyq": (4, "bf16", dict(direct128, early_q=True)),
             # ... with 32 sequences (16 parts of 2 CTAs): is the hand-over the DRAM burst of every CTA switching units
             # at once (each loads a query and two steps, ~221 KB), or the CTA's own latency?
             "bf16-128-persistent-b32": (4, "bf16", pick_tiling(128, "bf16", "sm_90a", 64), 32)}
    ncu = "--ncu" in sys.argv[1:]
    names = [a for a in sys.argv[1:] if a != "--ncu"]
    unknown = set(names) - set(cases)
    if unknown:
        print(f"bench.trace_mla: unknown cases {sorted(unknown)}; known: {sorted(cases)}", file=sys.stderr)
        return 2
    for ci, fmt, tiling, *batch in [cases[n] for n in (names or cases)]:
        case = dict(PRESETS["decode"][ci], **({"b": batch[0]} if batch else {}))
        i = make_inputs(case, "cuda")
        b, s_q, h_q = case["b"], case["s_q"], case["h_q"]
        rows = s_q * h_q
        sched = get_mla_schedule(i["lens"], s_q, h_q, i["table"].shape[1])
        # the stamps live in the partials buffer: only an unsplit run leaves it alone (the persistent case deals whole
        # sequences of its own below, whatever the schedule's splits)
        assert sched.max_splits == 1 or (tiling or {}).get("persistent")
        kv = ops.quantize_mla_kv_fp8(i["kv"]) if fmt == "fp8" else i["kv"]
        page = kv.shape[1]
        tiling = tiling or pick_tiling(rows, fmt, "sm_90a", page)
        if ncu:                  # the production kernel (no stamps), once compiled, once under the profiler
            run = lambda: _mla_decode_impl(i["q"], kv, i["table"], i["lens"], i["scale"], True, sched,  # noqa: E731
                                           tiling=tiling, kv_format=fmt)
            run()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            run()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            print(f"== {case} {fmt} {tiling}: one run under the profiler")
            continue
        kernel = mla_decode_program.compile("sm_90a", h_q=h_q, s_q=s_q, page=page, dtype="bfloat16", causal=True,
                                            trace=True, **tiling)
        kvv = kv.view(kv.shape[0], page, kv.shape[-1])
        if fmt == "fp8":
            kvv = kvv.view(torch.float8_e4m3fn)
        out = torch.empty(b, s_q, h_q, D_V, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device="cuda")
        o_part = torch.zeros(1, 64 * -(-rows // 64), D_V, dtype=torch.float32, device="cuda")
        lse_part = torch.empty(1, 64 * -(-rows // 64), dtype=torch.float32, device="cuda")
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        m_tiles = -(-rows // 64)
        units, ctas = (), b * m_tiles
        if tiling.get("persistent"):
            # each sequence a whole piece (no partials: OPart[0] holds the stamps), two a part (b even)
            nblk = (i["lens"].long() + 63) // 64
            ar = torch.arange(b, device="cuda")
            pieces = torch.stack([ar, ar * 0, nblk, ar, ar * 0 + 1, ar], 1).to(torch.int32).contiguous()
            part_start = torch.arange(0, b + 1, 2, device="cuda", dtype=torch.int32)
            units = (pieces, part_start, torch.zeros(2 * b * m_tiles, dtype=torch.int32, device="cuda"))
            ctas = b // 2 * m_tiles
        for _ in range(3):
            kernel.launcher()(i["q"].view(b, rows, D_QK), kvv, kvv.view(torch.float32), kvv.view(torch.bfloat16),
                              i["table"], i["lens"], sched.splits, out.view(b, rows, D_V), lse, o_part, lse_part,
                              *units, 1, float(i["scale"] * LOG2E))
        torch.cuda.synchronize()
        st = o_part[0, :64, :TIMELINE_COL].contiguous().view(torch.int32).long().cpu()
        base = st[:, 0]
        print(f"== {case} {fmt} {tiling}: step period (wg0 ready k+1 - k), cycles:",
              [int(x) for x in (base[1:33] - base[:32])])
        if units:
            print("  persistent, pairs 28-63 (the second unit from 32):", [int(x) for x in (base[29:64] - base[28:63])])
            for e, name in enumerate(EVENTS):     # the hand-over: each event of pairs 29-34 against pair 29's start
                if st[28:36, e].any():
                    print(f"  {name:18s} pairs 29-34 rel. to pair 29's wg0 ready: "
                          f"{[int(st[k, e] - base[29]) for k in range(29, 35)]}")
        for e, name in enumerate(EVENTS):
            if not st[20:28, e].any():
                continue  # an event this pipeline does not have
            if tiling.get("seesaw") and name.startswith("prod"):   # stamped by step: pair k's two steps
                for h in range(2):
                    d = [int(st[2 * k + h, e] - base[k]) for k in range(20, 28)]
                    print(f"  {name + ' e' + str(h):18s} rel. to wg0 ready: {d}")
                continue
            d = [int(st[k, e] - base[k]) for k in range(20, 28)]
            print(f"  {name:18s} rel. to wg0 ready: {d}")
        if o_part.shape[1] >= 128:   # CTA 1: the other 64-row tile of sequence 0 (lowering's _stamp)
            sib = o_part[0, 64:128, :1].contiguous().view(torch.int32).long().cpu()[:, 0]
            print("  CTA 1 (sibling tile) step period:", [int(x) for x in (sib[1:33] - sib[:32])])
            print("  CTA 1 wg0 ready - CTA 0 wg0 ready (clocks of two SMs, offset unknown but fixed):",
                  [int(x) for x in (sib[:32] - base[:32])])
        print(timeline(o_part[0], ctas, sms))
    return 0


def timeline(part, ctas, sms):
    """Summary of the CTAs' timelines in `part` (trace[0]; lowering/sm90_attention.py's _timeline)."""
    words = part.contiguous().view(torch.int32).cpu().long() & 0xFFFFFFFF

    def event(cta, e):
        flat = cta * 2 + e
        w = words[flat // TIMELINE_PER_ROW, TIMELINE_COL + (flat % TIMELINE_PER_ROW) * 8:][:5]
        return int(w[0] | (w[1] << 32)), int(w[2] | (w[3] << 32)), int(w[4])   # ns, SM clock, SM id

    ev = [(event(c, 0), event(c, 1)) for c in range(ctas)]
    t0 = min(a[0] for a, _ in ev)
    dur = torch.tensor([(z[0] - a[0]) / 1e3 for a, z in ev])               # us
    ghz = torch.tensor([(z[1] - a[1]) / max(z[0] - a[0], 1) for a, z in ev])
    span = (max(z[0] for _, z in ev) - t0) / 1e3
    starts = sorted((a[0] - t0) / 1e3 for a, _ in ev)
    first_wave = sum(1 for x in starts if x < 1.0)
    return (f"  timeline: {ctas} CTAs on {len({a[2] for a, _ in ev})} SMs; span {span:.1f} us (first start to last "
            f"end); CTA duration mean {dur.mean():.1f} min {dur.min():.1f} max {dur.max():.1f} us; SM clock median "
            f"{ghz.median():.3f} GHz; {first_wave} CTAs start within 1 us, the last at {starts[-1]:.1f} us; "
            f"SMs busy {dur.sum() / (sms * span):.0%} of the span")


if __name__ == "__main__":
    sys.exit(main())
