"""Compile ops ahead of time into the disk cache, with a progress bar.

    python -m codegen.warmup rmsnorm mla_decode --target sm_90a       # every example of each
    python -m codegen.warmup all --target sm_90a --example v3-hidden
    python -m codegen.warmup mla_decode --target sm_90a --example h16 \\
        --grid h_q=16,32,64,128 --grid s_q=1,2 --jobs 14               # 8 variants, 14 processes

--grid NAME=V1,V2,... varies a parameter over each chosen example (the cartesian product of all
grids); --jobs compiles in that many processes (nvcc and TileLang's passes are single-threaded, so
a GPU host's cores fill the cache before its tests need it, instead of one compile at a time).
"""

from __future__ import annotations

import argparse
import ast
import itertools
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed

from codegen import program as programs
from codegen import targets
from codegen.show import parse_params, resolve_program


def parse_grid(items: list[str]) -> list[dict]:
    """['h_q=16,32', 's_q=1,2'] -> the 4 parameter dicts of their product."""
    axes = []
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--grid takes NAME=V1,V2,..., got {item!r}")
        name, values = item.split("=", 1)
        parsed = []
        for v in values.split(","):
            try:
                parsed.append(ast.literal_eval(v))
            except (ValueError, SyntaxError):
                parsed.append(v)
        axes.append([(name, v) for v in parsed])
    return [dict(combo) for combo in itertools.product(*axes)]


def _compile(name: str, target: str, params: dict) -> str:
    # runs in a worker process too: resolve the program there
    resolve_program(name).compile(target, **params)
    return name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m codegen.warmup", description=__doc__.split("\n")[0])
    ap.add_argument("ops", nargs="+", help="program or op names, or 'all'")
    ap.add_argument("--target", required=True, help="sm_90a | sm_100a | ascend | cpu")
    ap.add_argument("--example", default=None, help="only this example of each program (default: all of them)")
    ap.add_argument("--param", action="append", default=[], help="override a parameter: NAME=VALUE")
    ap.add_argument("--grid", action="append", default=[], help="vary a parameter: NAME=V1,V2,... (repeatable)")
    ap.add_argument("--jobs", type=int, default=1, help="compile in this many processes (default 1)")
    args = ap.parse_args(argv)
    from tqdm import tqdm

    try:
        if args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        target = targets.get(args.target)
        import ops  # noqa: F401

        names = sorted(programs.PROGRAMS) if args.ops == ["all"] else args.ops
        grid = parse_grid(args.grid)
        jobs = []
        for name in names:
            prog = resolve_program(name)
            if target.name not in prog.targets:
                print(f"skip {prog.name}: no lowering for {target.name}", file=sys.stderr)
                continue
            chosen = [args.example] if args.example else list(prog.examples)
            for ex in chosen:
                for point in grid:
                    params = prog.example(ex)
                    params.update(parse_params(args.param))
                    params.update(point)
                    prog.bind(params)  # a wrong name fails here, before any compile
                    jobs.append((prog.name, target.name, params))
        jobs = list({repr(sorted(p.items())) + n: (n, t, p) for n, t, p in jobs}.values())  # drop repeats
        failed = 0
        bar = tqdm(total=len(jobs), desc=f"compiling for {target.name}", unit="kernel")
        if args.jobs == 1:
            for job in jobs:
                _compile(*job)
                bar.update()
        else:
            with ProcessPoolExecutor(args.jobs) as pool:
                futures = {pool.submit(_compile, *job): job for job in jobs}
                for fut in as_completed(futures):
                    try:
                        fut.result()
                    except Exception as e:  # report every failing variant, then fail
                        failed += 1
                        print(f"failed {futures[fut]}: {type(e).__name__}: {e}", file=sys.stderr)
                    bar.update()
        bar.close()
        if failed:
            print(f"{failed} of {len(jobs)} kernels failed for {target.name}", file=sys.stderr)
            return 1
        print(f"{len(jobs)} kernels ready for {target.name}")
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
