"""Each MLA provider's distance from an fp64 reference (not the first provider's output, as bench.op reports it).

    python -m bench.acc_mla --shape h128 --providers tilecraft,tilecraft-persistent-lazy,flash_mla

One line a (case, provider): rel L2 = |out - ref| / |ref| over the whole output, max |out - ref|, and max |lse - ref|
over the finite entries. The reference is ops.mla_decode_reference on float64 copies of the same bf16 inputs.
"""

import argparse

import torch

import ops
from bench.suites.mla import PRESETS, SUITE, make_inputs
from bench.warm import warm_and_say


def distances(out, lse, ref_out, ref_lse) -> dict:
    d = out.double() - ref_out
    finite = torch.isfinite(ref_lse)
    return {"rel_l2": float(d.norm() / ref_out.norm()), "max_abs": float(d.abs().max()),
            "lse_max_abs": float((lse.double() - ref_lse)[finite].abs().max())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="h128", choices=sorted(PRESETS))
    ap.add_argument("--providers", required=True, help="comma-separated names from bench.suites.mla")
    ap.add_argument("--jobs", type=int, default=8, help="processes that compile the kernels first (bench/warm.py)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.acc_mla needs a CUDA GPU (torch.cuda.is_available() is False)")
    by_name = {p.name: p for p in SUITE.providers}
    wanted = args.providers.split(",")
    unknown = [w for w in wanted if w not in by_name]
    if unknown:
        raise SystemExit(f"unknown providers {unknown}; known: {sorted(by_name)}")
    warm_and_say("mla", args.shape, [w for w in wanted if not by_name[w].available()], args.jobs)
    for case in PRESETS[args.shape]:
        i = make_inputs(case, "cuda")
        ref_out, ref_lse = ops.mla_decode_reference(i["q"].double(), i["kv"].double(), i["table"], i["lens"],
                                                    softmax_scale=i["scale"])
        label = SUITE.label(case)
        for name in wanted:
            p = by_name[name]
            why = p.available()
            if why:
                print(f"{label:44s} {name:28s} skipped: {why}")
                continue
            out, lse = p.make(case, i)()
            torch.cuda.synchronize()
            r = distances(out, lse, ref_out, ref_lse)
            print(f"{label:44s} {name:28s} rel_l2 {r['rel_l2']:.3e}  max_abs {r['max_abs']:.3e}  "
                  f"lse_max_abs {r['lse_max_abs']:.3e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
