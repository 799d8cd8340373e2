"""Compile ops ahead of time into the disk cache, with a progress bar.

    python -m codegen.warmup rmsnorm mla_decode --target sm_90a       # every example of each
    python -m codegen.warmup all --target sm_90a --example v3-hidden
"""

from __future__ import annotations

import argparse
import sys

from codegen import program as programs
from codegen import targets
from codegen.show import parse_params, resolve_program


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m codegen.warmup", description=__doc__.split("\n")[0])
    ap.add_argument("ops", nargs="+", help="program or op names, or 'all'")
    ap.add_argument("--target", required=True, help="sm_90a | sm_100a | ascend | cpu")
    ap.add_argument("--example", default=None, help="only this example of each program (default: all of them)")
    ap.add_argument("--param", action="append", default=[], help="override a parameter: NAME=VALUE")
    args = ap.parse_args(argv)
    from tqdm import tqdm

    try:
        target = targets.get(args.target)
        import ops  # noqa: F401

        names = sorted(programs.PROGRAMS) if args.ops == ["all"] else args.ops
        jobs = []
        for name in names:
            prog = resolve_program(name)
            if target.name not in prog.targets:
                print(f"skip {prog.name}: no lowering for {target.name}", file=sys.stderr)
                continue
            chosen = [args.example] if args.example else list(prog.examples)
            for ex in chosen:
                params = prog.example(ex)
                params.update(parse_params(args.param))
                jobs.append((prog, ex, params))
        for prog, ex, params in tqdm(jobs, desc=f"compiling for {target.name}", unit="kernel"):
            prog.compile(target, **params)
        print(f"{len(jobs)} kernels ready for {target.name}")
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
