"""Summarize ncu's per-SASS-instruction export of a kernel (stall reasons and instruction mix).

    ncu --section SourceCounters --section WarpStateStats -o rep python3 ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > k.csv
    python -m bench.ncu_sass k.csv [other.csv ...]

Per file: warp-level instructions executed, the stall-sample reasons, the opcode mix by executed count
and by samples, and the code split by execution count (the hot loop is the largest group: its
instructions all run the same number of times).
"""

import collections
import csv
import sys


def _num(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def _opcode(source: str) -> str:
    words = source.split()
    if not words:
        return ""
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op.split(".")[0]


def load(path: str) -> list[dict]:
    rows = list(csv.reader(open(path)))
    header = rows[1]                     # row 0 names the kernel
    return [dict(zip(header, r)) for r in rows[2:] if len(r) >= len(header) - 1]


def summary(path: str) -> str:
    rows = load(path)
    stalls = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    executed = sum(_num(r["Instructions Executed"]) for r in rows)
    samples = sum(_num(r["Warp Stall Sampling (All Samples)"]) for r in rows) or 1.0
    reasons = collections.Counter({k[6:]: sum(_num(r[k]) for r in rows) for k in stalls})
    by_exec, by_samp = collections.Counter(), collections.Counter()
    groups = collections.defaultdict(lambda: [0, 0.0, collections.Counter()])
    for r in rows:
        op, e, s = _opcode(r["Source"]), _num(r["Instructions Executed"]), _num(r["Warp Stall Sampling (All Samples)"])
        by_exec[op] += e
        by_samp[op] += s
        g = groups[e]
        g[0] += 1
        g[1] += s
        g[2][op] += 1
    out = [f"== {path}: {executed:.4g} warp instructions executed, {samples:.0f} samples",
           "  stalls: " + ", ".join(f"{k} {v / samples:.1%}" for k, v in reasons.most_common(10)),
           "  executed: " + ", ".join(f"{k} {v / max(executed, 1):.1%}" for k, v in by_exec.most_common(14)),
           "  sampled: " + ", ".join(f"{k} {v / samples:.1%}" for k, v in by_samp.most_common(10))]
    for e, (n, s, ops) in sorted(groups.items(), key=lambda kv: -kv[0] * kv[1][0])[:5]:
        mix = ", ".join(f"{k} {v}" for k, v in ops.most_common(8))
        out.append(f"  {n} instructions run {e:.0f} times each: {s / samples:.1%} of samples ({mix})")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for p in sys.argv[1:]:
        print(summary(p))
