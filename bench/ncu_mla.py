"""One MLA decode call of a bench.suites.mla provider inside a profiler range, for ncu:

    ncu --profile-from-start off --section WarpStateStats --section SchedulerStats \\
        python -m bench.ncu_mla tilecraft-persistent 128x128x1x4096 [--calls 1]

The provider (any of `python -m bench.op mla`'s: tilecraft, tilecraft-seesaw, tilecraft-persistent, flash_mla, ...)
is built on the suite's inputs for the case b x h_q x s_q x seqlen and run once before the range opens (compilation,
FlashMLA's first-call schedule), then --calls times inside it.
"""

import argparse

import torch

from bench.ncu_call import profile_calls
from bench.suites.mla import SUITE


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("provider", help="a provider of the mla bench suite")
    ap.add_argument("case", help="b x h_q x s_q x seqlen, e.g. 128x128x1x4096")
    ap.add_argument("--calls", type=int, default=1)
    args = ap.parse_args(argv)
    providers = {p.name: p for p in SUITE.providers}
    if args.provider not in providers:
        raise SystemExit(f"no mla provider {args.provider!r}; known: {sorted(providers)}")
    provider = providers[args.provider]
    missing = provider.available()
    if missing:
        raise SystemExit(f"{args.provider}: {missing}")
    b, h_q, s_q, seqlen = (int(x) for x in args.case.lower().split("x"))
    case = dict(b=b, h_q=h_q, s_q=s_q, seqlen=seqlen)
    call = provider.make(case, SUITE.make_inputs(case, "cuda"))
    profile_calls(call, args.calls)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
