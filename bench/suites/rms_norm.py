"""RMSNorm: memory-bound; bytes = read x + write y (+ the weight once)."""

import torch

import ops
from bench.suites import Provider, Suite
from ops.rms_norm import DTYPES, rmsnorm_program

ELEM = {"bfloat16": 2, "float16": 2, "float32": 4}


def _cases(rows_list, hidden_list, dtype="bfloat16"):
    return [dict(rows=r, hidden=h, dtype=dtype) for h in hidden_list for r in rows_list]


PRESETS = {
    "model": _cases([1, 64, 4096, 16384], [7168, 1536, 512]),
    "large": _cases([16384, 65536], [7168]),
    "small": _cases([1, 7], [512]),
}


def make_inputs(case, device):
    dt = getattr(torch, case["dtype"])
    x = torch.randn(case["rows"], case["hidden"], dtype=dt, device=device)
    w = torch.randn(case["hidden"], dtype=dt, device=device)
    return {"x": x, "w": w}


def nbytes(case):
    e = ELEM[case["dtype"]]
    return 2 * case["rows"] * case["hidden"] * e + case["hidden"] * e


def flops(case):
    return 4 * case["rows"] * case["hidden"]


SUITE = Suite(
    name="rms_norm",
    presets=PRESETS,
    make_inputs=make_inputs,
    nbytes=nbytes,
    flops=flops,
    providers=[
        Provider("tilecraft", lambda c, i: (lambda: ops.rms_norm(i["x"], i["w"]))),
        Provider("torch", lambda c, i: (lambda: torch.nn.functional.rms_norm(i["x"], (c["hidden"],), i["w"], 1e-6))),
    ],
    kernels=lambda c, t: [(rmsnorm_program, dict(hidden=c["hidden"], dtype=c["dtype"]))],
    label=lambda c: f"rows={c['rows']} hidden={c['hidden']} {c['dtype']}",
)
assert set(DTYPES.values()) >= set(ELEM)
