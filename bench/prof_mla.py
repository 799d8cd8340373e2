"""Where an MLA decode call's GPU time goes, kernel by kernel (torch profiler, L2 flushed before every call):
the main kernel against the combine of the split sequences, for each schedule / combine path on a bench.suites.mla
preset (default `few`: a batch of one to three 64-row tiles, long contexts: many splits a sequence).

    python -m bench.prof_mla [--shape few] [--paths default s56 cw splits-2 splits-1] [--fp8] [--out DIR]

Paths: default (the op: get_mla_schedule's defaults, its choice of combine); s56 (the op before session 57: at most
32 splits a sequence, the three-pass combine); cw (the wide combine at any split count); splits-2 / splits-1 (at
least 2 / 1 blocks a split instead of 4). Prints one line per (case, path, kernel): mean GPU microseconds per
call, then the sum, and the schedule's largest split count. GPU only.
"""

import argparse
import json
from pathlib import Path

import ops
from bench.suites.mla import PRESETS, combine_lanes, make_inputs
from bench.timing import mean_kernel_times
from ops.mla_decode import _mla_decode_impl, get_mla_schedule

REPS = 30
# path -> (get_mla_schedule's knobs, bench.suites.mla.combine_lanes's combine)
PATHS = {"default": ({}, None), "s56": (dict(max_splits=32), "3pass"), "cw": ({}, "wide"),
         "splits-2": (dict(min_split_blocks=2), None), "splits-1": (dict(min_split_blocks=1), None)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="few", choices=list(PRESETS))
    ap.add_argument("--paths", nargs="*", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--fp8", action="store_true", help="the FP8 cache (ops.quantize_mla_kv_fp8 of the same cache)")
    ap.add_argument("--out", default=None, help="also write the table as JSON here")
    args = ap.parse_args(argv)
    fmt = "fp8" if args.fp8 else "bf16"
    rows = []
    for case in PRESETS[args.shape]:
        i = make_inputs(case, "cuda")
        kv = ops.quantize_mla_kv_fp8(i["kv"]) if args.fp8 else i["kv"]
        label = f"{case['b']}x{case['h_q']}x{case['s_q']}x{case['seqlen']}"
        for path in args.paths:
            knobs, combine = PATHS[path]
            sched = get_mla_schedule(i["lens"], case["s_q"], case["h_q"], i["table"].shape[1], kv_format=fmt, **knobs)
            run = lambda: _mla_decode_impl(i["q"], kv, i["table"], i["lens"], i["scale"], True, sched,  # noqa: E731, B023
                                           kv_format=fmt, combine_lanes=combine_lanes(combine, sched.max_splits))
            times = mean_kernel_times(run, REPS)
            for name, us in sorted(times.items(), key=lambda kv_: -kv_[1]):
                print(f"{label:18s} {fmt:4s} {path:13s} {us:8.2f} us  {name}")
                rows.append(dict(case=label, kv_format=fmt, path=path, kernel=name, us=us,
                                 max_splits=sched.max_splits))
            print(f"{label:18s} {fmt:4s} {path:13s} {sum(times.values()):8.2f} us  (sum; max_splits {sched.max_splits})")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"prof-mla-{args.shape}-{fmt}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
