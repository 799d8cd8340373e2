"""Where an MXFP4 decode call's GPU time goes, kernel by kernel (torch profiler, L2 flushed before
every call): the swapped register-decode kernel (one or two blocks an SM) and its split-K reduce
against the decoded-tile kernel (ops.gemm_mxfp4.SWAPPED off), on bench.suites.gemm's mxfp4 preset.

    python -m bench.prof_mxfp4 [--out DIR] [--no-decode]

Prints one line per (case, path, kernel): mean GPU microseconds per call. GPU only.
--no-decode (a diagnostic, wrong results): the swapped kernel's helper copies the raw code words
into the fragments instead of decoding them, so what is left is the kernel's loads, WGMMAs and
barriers: how much of a step the decode costs.
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.suites.gemm import PRESETS, make_inputs
from bench.timing import L2_FLUSH_BYTES
from ops import gemm_mxfp4

REPS = 30

# the swapped kernel's helper with the decode taken out: the raw words go into the fragments as
# they are (mixed with the scale words and the byte position, so that nothing is optimized away)
NO_DECODE_SOURCE = r"""
__device__ __forceinline__ void tc_e2m1_fragment(void* dst, const void* w0, const void* w1, const void* w2,
                                                 const void* w3, const void* v0, const void* v1, const void* v2,
                                                 const void* v3, int sw_r, int sw_r8, int c) {
  const uint4 wq[4] = {*reinterpret_cast<const uint4*>(w0), *reinterpret_cast<const uint4*>(w1),
                       *reinterpret_cast<const uint4*>(w2), *reinterpret_cast<const uint4*>(w3)};
  const uint4 vq[4] = {*reinterpret_cast<const uint4*>(v0), *reinterpret_cast<const uint4*>(v1),
                       *reinterpret_cast<const uint4*>(v2), *reinterpret_cast<const uint4*>(v3)};
  const unsigned* wr = reinterpret_cast<const unsigned*>(wq);
  const unsigned* vr = reinterpret_cast<const unsigned*>(vq);
  unsigned* d = reinterpret_cast<unsigned*>(dst);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    d[4 * j + 0] = wr[2 * j] ^ (unsigned)sw_r;
    d[4 * j + 1] = vr[2 * j] ^ (unsigned)sw_r8;
    d[4 * j + 2] = wr[2 * j + 1] ^ (unsigned)c;
    d[4 * j + 3] = vr[2 * j + 1];
  }
}
"""


def _swapped(blocks_per_sm):
    def make(a, b, s):
        def run():
            out = torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16, device=a.device)
            gemm_mxfp4._launch_swapped(a, b, s, out, blocks_per_sm=blocks_per_sm)
            return out
        return run
    return make


def _tile(a, b, s):
    def run():
        out = torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16, device=a.device)
        gemm_mxfp4._launch(a, b, s, out)
        return out
    return run


# the swapped kernel at one or two blocks an SM, and the decoded-tile kernel (SWAPPED off)
PATHS = {"swapped-1": _swapped(1), "swapped-2": _swapped(2), "tile": _tile}


def kernel_times(fn, reps=REPS):
    """{kernel name: mean GPU us per call} over reps calls, each after an L2 flush."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    total = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and "fill" not in ev.name and "zero" not in ev.name:
            total[ev.name[:60]] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return {name: t / reps for name, t in total.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the table as JSON here")
    ap.add_argument("--no-decode", action="store_true",
                    help="diagnostic: the swapped kernel without its decode (wrong results; its own cache key)")
    args = ap.parse_args(argv)
    if args.no_decode:
        gemm_mxfp4.E2M1_FRAGMENT_SOURCE = NO_DECODE_SOURCE
    rows = []
    for case in PRESETS["mxfp4"]:
        i = make_inputs(case, "cuda")
        a, b, s = i["a"][0], i["packed"][0], i["scales"][0]
        for path in PATHS:
            times = kernel_times(PATHS[path](a, b, s))
            label = f"{case['m']}x{case['n']}x{case['k']}"
            for name, us in sorted(times.items(), key=lambda kv: -kv[1]):
                print(f"{label:14s} {path:8s} {us:8.2f} us  {name}")
                rows.append(dict(case=label, path=path, kernel=name, us=us))
            print(f"{label:14s} {path:8s} {sum(times.values()):8.2f} us  (sum)")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = "prof-mxfp4-no-decode.json" if args.no_decode else "prof-mxfp4.json"
        (Path(args.out) / name).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
