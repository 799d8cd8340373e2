"""Where an MXFP4 decode call's GPU time goes, kernel by kernel (torch profiler, L2 flushed before
every call): the swapped register-decode kernel (one or two blocks an SM; swapped-tma /
swapped-ldg: its scale rows forced by TMA / by the MMA threads; swapped-ramp2: the first two
stages asked for alone; swapped-v6: the v6 decode; swapped-fold / -reduce: split-K folded in the kernel or
by the reduce kernel; swapped-ahead / -now: raw words loaded a step ahead of their decode or not;
swapped-pair / -unpaired: a 2-split plan's blocks folding in clusters of two, or not; swapped-staged /
-unstaged: the partials out through shared memory as whole rows, or from the accumulator layout; swapped-n128 /
-n64: the block width forced; swapped-chains-unsplit: the chains only where their plan has one split) and its
split-K reduce against the decoded-tile kernel (ops.gemm_mxfp4.SWAPPED off) and the W4A8 kernel (w4a8:
ops.mxfp4_w4a8_gemm_nt, e4m3 activations), on bench.suites.gemm's mxfp4 preset.

    python -m bench.prof_mxfp4 [--out DIR] [--no-decode] [--preset mxfp4-chains] [--paths swapped-1 swapped-ldg ...]

Prints one line per (case, path, kernel): mean GPU microseconds per call. GPU only.
--no-decode (a diagnostic, wrong results): the swapped kernel's helper copies the raw code words
into the fragments instead of decoding them, so what is left is the kernel's loads, WGMMAs and
barriers: how much of a step the decode costs.
"""

import argparse
import json
from pathlib import Path

import torch

from bench.suites.gemm import PRESETS, make_inputs
from bench.timing import mean_kernel_times
from ops import gemm_mxfp4

REPS = 30


def no_decode():
    """From here on the swapped kernel is built without its decode (its helper's TC_E2M1_NO_DECODE
    branch: the raw words go into the fragments as they are; wrong results). The helper text is in
    the JIT cache key, so this is a kernel of its own."""
    if "TC_E2M1_NO_DECODE 1" not in gemm_mxfp4.E2M1_FRAGMENT_SOURCE:
        gemm_mxfp4.E2M1_FRAGMENT_SOURCE = "#define TC_E2M1_NO_DECODE 1\n" + gemm_mxfp4.E2M1_FRAGMENT_SOURCE


def _swapped(blocks_per_sm, scale_tma=None, ramp=0, decode=None, fold=None, ahead=None, pair=None,
             stage_out=None, **width):
    # width: block_n (64 / 128 forced) or chains_where (ops.gemm_mxfp4.SWAPPED_CHAINS_WHERE's values)
    def make(a, b, s):
        def run():
            out = torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16, device=a.device)
            gemm_mxfp4._launch_swapped(a, b, s, out, blocks_per_sm=blocks_per_sm, scale_tma=scale_tma, ramp=ramp,
                                       decode=decode, fold=fold, ahead=ahead, pair=pair, stage_out=stage_out,
                                       **width)
            return out
        return run
    return make


def _tile(a, b, s):
    def run():
        out = torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16, device=a.device)
        gemm_mxfp4._launch(a, b, s, out)
        return out
    return run


def _w4a8(a, b, s):
    # ops.mxfp4_w4a8_gemm_nt on the same weights (prepared once) and the activations as e4m3 with a per-token scale
    from ops import gemm_w4a8

    af = a.float()
    sa = (af.abs().amax(-1) / 448).clamp(min=2 ** -120)
    a8 = (af / sa[:, None]).to(torch.float8_e4m3fn)
    prep = gemm_w4a8.prepare_mxfp4_w4a8(b, s)
    return lambda: gemm_w4a8.mxfp4_w4a8_gemm_nt(a8, sa, *prep)


# the swapped kernel at one or two blocks an SM, and the decoded-tile kernel (SWAPPED off); w4a8: the e4m3-activation
# kernel (its kernels: the GEMM and, where its plan has one, the split-K reduce)
PATHS = {"swapped-1": _swapped(1), "swapped-tma": _swapped(1, scale_tma=True),
         "swapped-ldg": _swapped(1, scale_tma=False), "swapped-ramp2": _swapped(1, ramp=2),
         "swapped-v6": _swapped(1, decode="v6"), "swapped-fold": _swapped(1, fold=True),
         "swapped-reduce": _swapped(1, fold=False), "swapped-ahead": _swapped(1, ahead=True),
         "swapped-now": _swapped(1, ahead=False), "swapped-pair": _swapped(1, pair=True),
         "swapped-unpaired": _swapped(1, pair=False), "swapped-staged": _swapped(1, stage_out=True),
         "swapped-unstaged": _swapped(1, stage_out=False),
         "swapped-2": _swapped(2), "swapped-n128": _swapped(1, block_n=128),
         "swapped-n64": _swapped(1, block_n=64), "swapped-chains-unsplit": _swapped(1, chains_where="unsplit"),
         "tile": _tile, "w4a8": _w4a8}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the table as JSON here")
    ap.add_argument("--no-decode", action="store_true",
                    help="diagnostic: the swapped kernel without its decode (wrong results; its own cache key)")
    ap.add_argument("--paths", nargs="*", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--preset", default="mxfp4", choices=[p for p in PRESETS if p.startswith("mxfp4")
                                                          and PRESETS[p][0]["kind"] == "mxfp4"])
    args = ap.parse_args(argv)
    if args.no_decode:
        no_decode()
    rows = []
    for case in PRESETS[args.preset]:
        i = make_inputs(case, "cuda")
        a, b, s = i["a"][0], i["packed"][0], i["scales"][0]
        for path in args.paths:
            times = mean_kernel_times(PATHS[path](a, b, s), REPS)
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
