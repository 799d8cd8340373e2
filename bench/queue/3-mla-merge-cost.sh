#!/usr/bin/env bash
# Session 76, call 3 (~3 min): what the cut pieces' code and merges cost. 66 x 8192 (h_q 128, 66 parts) with uniform
# lengths (no cuts) and with the balance preset's 8192 + 2i (the cut deal cuts ~every sequence), each with the op's
# tiling (persistent-lazy with the merge code), the same program with merge=False (no partials, arrivals or merge in
# the binary: wrong outputs where cut, a timing only) and the two-warpgroup schedule (tilecraft-plain). Written
# before the run: uniform, merge = no-merge ~= session 75's 274.6 us (the code's presence costs nothing); + 2i, the
# merges are call 2's loss (307.7 us), no-merge ~275.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/tilecraft-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,power.limit --format=csv,noheader | tee "$out/gpu.txt"
cat > /tmp/merge_cost.py <<'PY'
import sys, torch, importlib
import bench.suites.mla as S
from bench.timing import bench_graph
m = importlib.import_module("ops.mla_decode")
S.seqlens = lambda case: case["lens"]
base = m.pick_tiling(128, "bf16", "sm_90a", 64)
variants = {"merge": base, "no-merge": {**base, "merge": False}, "plain": dict(block_n=64, stages=2)}
if sys.argv[1:]:                 # compile one variant (in parallel processes; the disk cache keeps it)
    m.mla_decode_program.compile("sm_90a", h_q=128, s_q=1, page=64, dtype="bfloat16", causal=True,
                                 **variants[sys.argv[1]])
    sys.exit()
for name, lens in (("66 x 8192 uniform (no cuts)", [8192] * 66), ("66 x 8192 + 2i (the balance row: cuts)",
                   [8192 + 2 * k for k in range(66)])):
    i = S.make_inputs(dict(b=66, h_q=128, s_q=1, lens=lens), "cuda")
    sched = m.get_mla_schedule(i["lens"], 1, 128, i["table"].shape[1])
    pieces, start = sched.persistent_pieces(66)
    print("==", name, "pieces", int(start[-1]), flush=True)
    run = {k: (lambda t=t: m._mla_decode_impl(i["q"], i["kv"], i["table"], i["lens"], i["scale"], True, sched,
                                             tiling=t)) for k, t in variants.items()}
    outs = {k: f() for k, f in run.items()}
    print("merge == no-merge (expected where no cuts):", torch.equal(outs["merge"][0], outs["no-merge"][0]))
    for rnd in range(2):
        for k, f in run.items():
            r = bench_graph(f, flush_mode="read")
            print(rnd, k, "median", round(r["median_ms"] * 1e3, 1), "min", round(r["min_ms"] * 1e3, 1), "us", flush=True)
PY
for v in merge no-merge plain; do timeout 150 python3 /tmp/merge_cost.py $v > "$out/compile-$v.txt" 2>&1 & done; wait
timeout 100 python3 /tmp/merge_cost.py 2>&1 | grep -v Warning | tail -16 | tee "$out/merge-cost.txt"
