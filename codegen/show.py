"""Print what a tile program becomes on a target, with no GPU needed.

    python -m codegen.show rmsnorm --target ascend
    python -m codegen.show rmsnorm --target sm_90a --sass
    python -m codegen.show rmsnorm --target cpu --param hidden=512 --param dtype=float16
    python -m codegen.show --rules          # which rule lowers each word on each target
    python -m codegen.show --list           # programs and their examples
"""

from __future__ import annotations

import argparse
import ast
import sys

from codegen import program as programs
from codegen import rules, targets


def parse_params(items: list[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--param takes NAME=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k] = v
    return out


def resolve_program(name: str) -> programs.TileProgram:
    """Accept the program name or the op's public name (rms_norm -> rmsnorm)."""
    _register_all()

    aliases = {n.replace("_", ""): n for n in programs.PROGRAMS}
    key = name if name in programs.PROGRAMS else aliases.get(name.replace("_", ""), name)
    return programs.get(key)


def _register_all() -> None:
    """Import every module of ops/: the public ops and their kernel variants (ops.mla_decode_fp8_rows64, ...) register
    their tile programs when imported."""
    import importlib
    import pkgutil

    import ops

    for m in pkgutil.iter_modules(ops.__path__):
        importlib.import_module(f"ops.{m.name}")


def sass_report(prog, target, params) -> str:
    from backends.cuda.sass import build_cubin, sass_stats

    src = prog.source(target, **params)
    return sass_stats(build_cubin(src, target.arch), target.arch).format()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m codegen.show", description=__doc__.split("\n")[0])
    ap.add_argument("op", nargs="?", help="tile program or op name (e.g. rmsnorm, mla_decode)")
    ap.add_argument("--target", default="sm_90a", help="sm_90a | sm_100a | ascend | cpu (default sm_90a)")
    ap.add_argument("--example", default=None, help="which of the program's example parameter sets")
    ap.add_argument("--param", action="append", default=[], help="override a parameter: NAME=VALUE")
    ap.add_argument("--sass", action="store_true", help="CUDA only: build a cubin and print its SASS summary")
    ap.add_argument("--no-source", action="store_true", help="skip the source listing")
    ap.add_argument("--rules", action="store_true", help="print the rule table and exit")
    ap.add_argument("--list", action="store_true", help="list programs and examples and exit")
    args = ap.parse_args(argv)

    if args.rules:
        for word, slot in rules.table().items():
            print(f"{word:18s} " + "  ".join(f"{p} <- {o}" for p, o in slot.items()))
        return 0
    if args.list:
        _register_all()
        for name, p in sorted(programs.PROGRAMS.items()):
            print(f"{name:22s} targets: {', '.join(p.targets)}   examples: {', '.join(p.examples)}")
        return 0
    if not args.op:
        ap.error("name an op (or use --rules / --list)")
    try:
        target = targets.get(args.target)
        prog = resolve_program(args.op)
        params = prog.example(args.example)
        params.update(parse_params(args.param))
        if args.sass and target.vendor != "cuda":
            raise ValueError(f"--sass needs a CUDA target, got {target.name}")
        print(f"// {prog.name} on {target.name} with {params}", flush=True)
        if not args.no_source:
            print(prog.source(target, **params))
        if args.sass:
            print(sass_report(prog, target, params))
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
