"""Benchmark one op family against its peers, side by side in one run.

    python -m bench.op rms_norm --shape model
    python -m bench.op mla --shape decode --plot
    python -m bench.op OP --shape PRESET --providers tilecraft,flash_mla --out bench/results

On a GPU (after compiling the run's kernels in --jobs processes, bench/warm.py): median and min of
CUDA-event-timed runs (L2 flushed before each; a wide gap between the two usually means host work
inside the timed region; timed calls skip the checks that read tensor values,
TILECRAFT_CHECK_VALUES=0, after one checked call), TFLOP/s, GB/s, % of the card's ceiling,
the floor and what sets it, each provider's speed relative to the reference provider, and how far
each provider's output is from the first provider's on the same inputs (`rel err`: a peer that is
fast because it computes something else shows here); CSV + JSON with GPU name, versions and time.
Without a GPU: builds the kernels for --target, prints their static stats (registers, shared
memory, tensor-core and memory instructions) and each shape's roofline floor on the reference GPU,
and says that timing needs a GPU.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import platform
import re
import statistics
import sys
from pathlib import Path

from bench import roofline
from bench.timing import FLUSH_MODES, SmClock, card_identity
from bench.warm import warm_and_say
from bench import suites as suite_registry

RESULTS = Path(__file__).resolve().parent / "results"
AGREE_WARN = 2e-2   # rel L2 distance between two providers' outputs worth a line on stderr (FP4/FP8 vs bf16 ~1e-2)


def versions() -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    try:
        import tilelang

        out["tilelang"] = tilelang.__version__
    except ImportError:
        out["tilelang"] = None
    from tilecraft import __version__

    out["tilecraft"] = __version__
    return out


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def values_unchecked():
    """TILECRAFT_CHECK_VALUES=0 inside: the checks that read tensor values (m_indices, masked_m,
    block_table ranges) cost a device sync per call, which an engine's hot path (a CUDA graph) never
    pays; each provider's first call, outside the timing, runs with them."""
    from tilecraft import env

    return env.overridden("TILECRAFT_CHECK_VALUES", "0")


def first_tensor(out):
    """The tensor a provider's call returned (the first of a tuple: MLA's (out, lse)), or None."""
    import torch

    while isinstance(out, (tuple, list)) and out:
        out = out[0]
    return out if isinstance(out, torch.Tensor) else None


def agreement(out, anchor) -> dict:
    """|out - anchor| against the anchor provider's output on the same inputs, in fp32: the largest
    element difference and the relative L2 distance; NaN/inf anywhere in `out` is reported, not hidden."""
    import torch

    x, y = first_tensor(out), first_tensor(anchor)
    if x is None or y is None:
        return {"agree_note": "no tensor returned"}
    if x.shape != y.shape:
        return {"agree_note": f"shape {tuple(x.shape)} vs {tuple(y.shape)}"}
    x, y = x.float(), y.float()
    finite = bool(torch.isfinite(x).all())
    d = (x - y).nan_to_num(nan=float("inf"))
    return {"max_abs_diff": d.abs().max().item() if d.numel() else 0.0,
            "rel_diff": (d.norm() / y.norm().clamp_min(1e-30)).item() if d.numel() else 0.0,
            **({} if finite else {"agree_note": "non-finite output"})}


def print_table(rows: list[dict], ref: str) -> None:
    head = (f"{'case':44s} {'provider':12s} {'ms':>9s} {'min ms':>9s} {'TFLOP/s':>8s} {'GB/s':>8s} {'%ceil':>6s} "
            f"{'floor%':>7s} {'vs ' + ref:>9s} {'rel err':>8s} {'SM MHz':>7s} {'W':>5s}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['case'][:44]:44s} {r['provider']:12s} {_fmt(r.get('median_ms'), '9.4f')} {_fmt(r.get('min_ms'), '9.4f')} "
              f"{_fmt(r.get('tflops'), '8.1f')} "
              f"{_fmt(r.get('gbps'), '8.0f')} {_fmt(r.get('pct_ceiling'), '6.1f')} {_fmt(r.get('pct_of_floor'), '7.1f')} "
              f"{_fmt(r.get('speedup_vs_ref'), '9.2f')} {_fmt(r.get('rel_diff'), '8.1e')} {_fmt(r.get('sm_mhz'), '7.0f')} "
              f"{_fmt(r.get('watts'), '5.0f')}")


HOST_BOUND_SPREAD = 1.5   # eager rows whose median is this many times their min get a note


def spread_notes(rows: list[dict], timing: str) -> list[str]:
    """A line per eager row whose median is HOST_BOUND_SPREAD x its min or more: such calls are
    host-bound (the launch path outlasts the kernel) or met a moving clock, so the median says little
    about the kernel; --graph times replays of the calls without the host."""
    if timing != "eager":
        return []
    return [f"note: {r['provider']} on {r['case']}: median {r['median_ms'] * 1e3:.1f} us is "
            f"{r['median_ms'] / r['min_ms']:.1f}x its min ({r['min_ms'] * 1e3:.1f} us): host-bound or a moving "
            f"clock; --graph times the kernels without the host"
            for r in rows if r.get("median_ms") and r.get("min_ms")
            and r["median_ms"] >= HOST_BOUND_SPREAD * r["min_ms"]]


def rotations(n: int, rounds: int) -> list[list[int]]:
    """The provider order of each timing round: round r starts at provider r mod n, so with as many
    rounds as providers each one is timed first once (the GPU's clock and power drift through a run:
    the first provider after an idle stretch and the last of a long run meet different clocks)."""
    return [[(r + j) % n for j in range(n)] for r in range(rounds)] if n else []


def combine_rounds(ts: list[dict]) -> dict:
    """One provider's timings over rounds: medians of the rounds' quantiles (min of their minima),
    reps summed, SM clock and power the medians of the rounds' medians; round_median_ms lists them."""
    if len(ts) == 1:
        return ts[0]

    def med(key):
        vals = [t[key] for t in ts if t.get(key) is not None]
        return statistics.median(vals) if vals else None

    out = {k: med(k) for k in ("median_ms", "p20_ms", "p80_ms", "sm_mhz", "watts")}
    out.update({k: med(k) for k in ("host_ms", "gpu_rep_ms") if med(k) is not None})     # eager timing only
    bound = [t["host_bound"] for t in ts if "host_bound" in t]
    return {**out, "min_ms": min(t["min_ms"] for t in ts), "reps": sum(t["reps"] for t in ts),
            "round_median_ms": [t["median_ms"] for t in ts], **({"host_bound": any(bound)} if bound else {})}


def run_gpu(suite, cases, providers, args) -> list[dict]:
    import torch

    from bench.timing import bench_cuda, bench_graph, measure_copy_gbps

    name = gpu_name()
    warm_and_say(suite.name, args.shape, [p.name for p in providers], args.jobs)
    ceil = roofline.ceilings_for(name)
    if args.measure_ceilings or name not in roofline.KNOWN:
        copy = measure_copy_gbps()
        print(f"measured copy bandwidth: {copy:.0f} GB/s (table: {ceil.copy_gbps:.0f})")
        ceil = roofline.Ceilings(name, copy, ceil.bf16_tflops, ceil.fp8_tflops, "measured in this run (copy)")
    rows = []
    for case in cases:
        inputs = suite.make_inputs(case, torch.device("cuda"))
        flops = suite.flops(case)
        case_rows = {}
        anchor = None  # (provider name, its output): every later provider's output is compared with it
        made = []      # (provider, row, fn, nbytes, floor, bound) of the providers that ran once
        for p in providers:
            # GB/s, %ceil and the floor on the bytes this provider moves (an FP8 cache moves fewer)
            nbytes = (p.nbytes or suite.nbytes)(case)
            floor, bound = roofline.floor_ms(nbytes, flops, ceil, suite.rate)
            row = {"case": suite.label(case), **{f"p_{k}": v for k, v in case.items()}, "provider": p.name,
                   "bytes": nbytes, "flops": flops, "floor_ms": floor, "bound": bound}
            try:
                fn = p.make(case, inputs)
                out = fn()
                if anchor is None:
                    t0 = first_tensor(out)
                    anchor = (p.name, None if t0 is None else t0.clone())
                else:
                    row.update(agree_with=anchor[0], **agreement(out, anchor[1]))
                    if row.get("agree_note") or row["rel_diff"] > AGREE_WARN:
                        print(f"  {p.name} on {row['case']}: output differs from {anchor[0]}'s "
                              f"({row.get('agree_note') or 'rel %.2e' % row['rel_diff']})", file=sys.stderr)
                del out
            except Exception as e:  # a provider that cannot run this shape says why, the rest go on
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                print(f"  {p.name} on {row['case']}: {row['error']}", file=sys.stderr)
                rows.append(row)
                continue
            if args.graph and not p.graphable:      # (a capture of its host sync would fail, and poison the stream)
                row["timing"] = "eager"
                print(f"  {p.name} on {row['case']}: timed eagerly (it syncs with the host: no CUDA graph)",
                      file=sys.stderr)
            made.append((p, row, fn, nbytes, floor, bound))
        timed = {p.name: [] for p, *_ in made}
        for order in rotations(len(made), args.rounds):
            for j in order:
                p, row, fn = made[j][:3]
                if "error" in row:
                    continue
                try:
                    # the first call checked the values; the hot path does not sync
                    with values_unchecked(), SmClock(torch.cuda.current_device()) as clock:
                        t = (bench_graph(fn, flush_mode=args.flush) if args.graph and p.graphable else
                             bench_cuda(fn, flush_mode=args.flush))
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    print(f"  {p.name} on {row['case']}: {row['error']}", file=sys.stderr)
                    continue
                t = {k: v / p.calls if k.endswith("_ms") else v for k, v in t.items()}
                t["sm_mhz"] = clock.median()            # the SM clock while it was timed (nvidia-smi)
                t["watts"] = clock.median_watts()       # and the board's power
                timed[p.name].append(t)
        for p, row, fn, nbytes, floor, bound in made:
            if "error" in row:
                rows.append(row)
                continue
            t = combine_rounds(timed[p.name])
            ms = t["median_ms"]
            row.update(t)
            if t.get("host_bound"):
                print(f"  {p.name} on {row['case']}: host-bound (the host issued a rep in {t['host_ms'] * 1e3:.0f} us, "
                      f"the GPU ran one in {t['gpu_rep_ms'] * 1e3:.0f} us): its eager times include host gaps; "
                      f"time it with --graph", file=sys.stderr)
            row["tflops"] = flops / (ms * 1e-3) / 1e12
            row["gbps"] = nbytes / (ms * 1e-3) / 1e9
            row["pct_ceiling"] = 100 * (row["gbps"] / ceil.copy_gbps if bound == "memory" else
                                        row["tflops"] / (ceil.fp8_tflops if suite.rate == "fp8" else ceil.bf16_tflops))
            row["pct_of_floor"] = 100 * floor / ms
            case_rows[p.name] = row
            rows.append(row)
        ref = case_rows.get(suite.reference)
        for r in case_rows.values():
            if ref is not None:
                r["speedup_vs_ref"] = ref["median_ms"] / r["median_ms"]
        del inputs
        torch.cuda.empty_cache()
    meta = {"gpu": name, **card_identity(torch.cuda.current_device()), "ceilings": ceil.__dict__,
            "timing": "cuda graph" if args.graph else "eager", "rounds": args.rounds,
            "l2_flush": args.flush, **versions()}
    peers = {p.name: peer_version(p.name) for p in providers if p.peer}
    if peers:
        meta["peers"] = peers
    return rows, meta


def peer_version(module: str) -> str | None:
    """A peer library's version as its module states it (FlashMLA's and DeepGEMM's names are their
    providers'), None when it states none."""
    import importlib

    return getattr(importlib.import_module(module), "__version__", None)


def choose_providers(suite, wanted: list[str] | None) -> list:
    """The providers to time: those named in `wanted` (all of them must exist), else every one that is
    not experimental (kernel variants the op does not choose run only when named); a provider whose
    library is missing is skipped with a line saying why."""
    if wanted:
        unknown = set(wanted) - {p.name for p in suite.providers}
        if unknown:
            raise ValueError(f"unknown providers {sorted(unknown)}; {suite.name} has {[p.name for p in suite.providers]}")
    providers = []
    for p in suite.providers:
        if (wanted and p.name not in wanted) or (p.experimental and not wanted):
            continue
        why = p.available()
        if why:
            print(f"provider {p.name} skipped: {why}")
            continue
        providers.append(p)
    return providers


def run_static(suite, cases, args) -> None:
    from codegen import targets

    target = targets.get(args.target or "sm_90a")
    ceil = roofline.ceilings_for(None)
    print(f"No CUDA GPU here ({_why_no_gpu()}): building the kernels for {target.name} and printing their "
          f"static stats and each shape's floor on the {ceil.gpu} ({ceil.source}).\n")
    seen = set()
    for case in cases:
        nbytes, flops = suite.nbytes(case), suite.flops(case)
        floor, bound = roofline.floor_ms(nbytes, flops, ceil, suite.rate)
        print(f"{suite.label(case)}: {nbytes / 1e6:.3g} MB, {flops / 1e9:.3g} GFLOP -> floor {floor * 1e3:.3g} us ({bound}-bound)")
        for prog, params in suite.kernels(case, target.name):
            key = (prog.name, tuple(sorted(params.items())))
            if key in seen:
                continue
            seen.add(key)
            print(f"  kernel {prog.name} {params} on {target.name}:")
            try:
                if target.vendor == "cuda":
                    from codegen.show import sass_report

                    print("    " + sass_report(prog, target, params).replace("\n", "\n    "))
                else:
                    src = prog.source(target, **params)
                    print(f"    generated {len(src.splitlines())} lines of source")
            except Exception as e:
                print(f"    could not build: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    print("\nTiming needs a CUDA GPU; run this again on one to measure against the peers.")


def _why_no_gpu() -> str:
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    return f"torch {torch.__version__} sees no CUDA device"


def write_results(rows, meta, suite, preset, out_dir: Path, plot: bool) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", meta["gpu"] or "nogpu").strip("-").lower()
    base = out_dir / f"{suite.name}-{preset}-{slug}-{stamp}"
    meta = {**meta, "op": suite.name, "preset": preset, "time_utc": stamp}
    Path(f"{base}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("case", "provider"), k))
    with open(f"{base}.csv", "w", newline="") as f:
        f.write("".join(f"# {k}: {v}\n" for k, v in meta.items()))
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    if plot:
        plot_rows(rows, f"{base}.png", f"{suite.name} {preset} on {meta['gpu']}")
    return base


def plot_rows(rows, path, title):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return
    cases = list(dict.fromkeys(r["case"] for r in rows))
    provs = list(dict.fromkeys(r["provider"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, len(cases) * 0.9), 4))
    width = 0.8 / max(1, len(provs))
    for i, p in enumerate(provs):
        vals = [next((r.get("pct_ceiling") or 0 for r in rows if r["case"] == c and r["provider"] == p), 0) for c in cases]
        ax.bar([x + i * width for x in range(len(cases))], vals, width, label=p)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cases))], cases, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("% of the card's ceiling")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.op", description=__doc__.split("\n")[0])
    ap.add_argument("op", help=f"one of: {', '.join(sorted(suite_registry.SUITE_MODULES))}")
    ap.add_argument("--shape", required=True, help="a preset of the op's suite")
    ap.add_argument("--providers", default=None, help="comma-separated subset (default: every available one)")
    ap.add_argument("--target", default=None, help="no-GPU mode: which target to build for (default sm_90a)")
    ap.add_argument("--out", default=str(RESULTS), help="where CSV/JSON go (default bench/results)")
    ap.add_argument("--plot", action="store_true", help="also write a PNG of %% of ceiling per case")
    ap.add_argument("--measure-ceilings", action="store_true", help="measure the copy bandwidth in this run")
    ap.add_argument("--graph", action="store_true",
                    help="time replays of a CUDA graph of the calls (no host launch cost) instead of eager calls")
    ap.add_argument("--flush", choices=FLUSH_MODES, default="write",
                    help="how the L2 is flushed before each call: write (zero-fill; the committed results) or "
                         "read (a sum: no dirty lines left to write back during the call)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every provider this many times per case, each round starting one provider later "
                         "(report: the median of the rounds' medians)")
    ap.add_argument("--jobs", type=int, default=8,
                    help="GPU runs: processes that compile the run's kernels ahead of the timing (1: none)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        print(f"error: --rounds must be at least 1, got {args.rounds}", file=sys.stderr)
        return 2
    try:
        suite = suite_registry.get(args.op)
        if args.shape not in suite.presets:
            raise ValueError(f"{suite.name} has no preset {args.shape!r}; presets: {', '.join(suite.presets)}")
        cases = suite.presets[args.shape]
        providers = choose_providers(suite, args.providers.split(",") if args.providers else None)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if gpu_name() is None:
        run_static(suite, cases, args)
        return 0
    rows, meta = run_gpu(suite, cases, providers, args)
    print(f"\n{suite.name} --shape {args.shape} on {meta['gpu']} (torch {meta['torch']}, tilelang {meta['tilelang']}; "
          f"{meta['timing']} timing)")
    print_table(rows, suite.reference)
    for line in spread_notes(rows, meta["timing"]):
        print(line)
    base = write_results(rows, meta, suite, args.shape, Path(args.out), args.plot)
    print(f"\nwrote {base}.csv and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
