"""Interleaved A/B of the FP8 cache's two-chain kernel (ops.mla_decode_fp8_rs2) variants through the op: one launch
of each variant in turn (the order reversed every other round), the L2 emptied before every launch, back to back.
Finer than bench.op's rounds for 1-3% differences (the card's clock and power drift between providers' blocks).

    python -m bench.ab_mla_rs2 '[{}, {"pace": 0}, {"third_fragment": null}]' [--flush read|write] [--launches 80]   # GPU

A variant is mla_decode_fp8_rs2_program's keyword arguments ({} is the op's kernel). --flush read (the default,
as bench --flush read) leaves the L2 clean; write leaves up to an L2 of dirty lines written back during the launch
(bench/NOTES.md "Session 40": -3.4% from the pace there, none on a clean L2). Event times include the launch.
"""

import argparse
import json
import sys

import torch

from bench.suites import mla as suite
from bench.timing import FLUSH_MODES, _flusher, card_identity

CASES = [(128, 16, 1, 4096), (128, 16, 1, 8192), (64, 16, 1, 8192), (128, 8, 2, 4096)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", help="a JSON list of keyword-argument dicts")
    ap.add_argument("--flush", choices=FLUSH_MODES, default="read")
    ap.add_argument("--launches", type=int, default=80, help="launches of each variant a case (the first 10 dropped)")
    args = ap.parse_args(argv)
    variants = json.loads(args.variants)
    if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants) or not variants:
        print(f"variants must be a non-empty JSON list of dicts, got {args.variants!r}", file=sys.stderr)
        return 2
    if args.launches <= 10:
        print(f"--launches must be more than 10 (the first 10 are dropped), got {args.launches}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench.ab_mla_rs2 needs a CUDA GPU (sm_90a): none found", file=sys.stderr)
        return 2
    flush = _flusher(True, args.flush)
    card = card_identity(torch.cuda.current_device())
    print(f"# {torch.cuda.get_device_name()} {card.get('gpu_uuid', '')}; flush {args.flush}; {args.launches} launches "
          f"a variant; us: median (p20-p80)")
    for b, h_q, s_q, n in CASES:
        case = dict(b=b, h_q=h_q, s_q=s_q, seqlen=n)
        inputs = suite.make_inputs(case, "cuda")
        runs = [suite.fp8_register(case, inputs, chains=2, **v) for v in variants]
        events = [[] for _ in variants]
        for it in range(args.launches):
            order = range(len(runs)) if it % 2 == 0 else reversed(range(len(runs)))
            for k in order:
                flush()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                runs[k]()
                e1.record()
                events[k].append((e0, e1))
        torch.cuda.synchronize()
        line = f"b={b} h_q={h_q} s_q={s_q} seqlen={n}:"
        for v, ev in zip(variants, events):
            t = sorted(a.elapsed_time(z) * 1e3 for a, z in ev[10:])
            line += f"  {json.dumps(v)} {t[len(t) // 2]:.1f} ({t[len(t) // 5]:.1f}-{t[4 * len(t) // 5]:.1f})"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
