"""Host (CPU) time per call of our kernels' launch paths next to plain torch launches, on a GPU.

    python -m bench.host_cost [NAME_SUBSTRING ...]

Eager decode-sized ops are host-bound when the host path costs more than the kernel: this prints
the median/min host microseconds of a torch launch, tvm_ffi's tensor conversion, a bare TileLang
launcher, our row-gather path, the FP8 GEMM at three depths (the public op, ops.gemm_fp8._launch,
the kernel launcher alone), the MXFP4 GEMM beside torch's bf16 GEMM of its shape, top-k (the op and
its scratch views) and MoE dispatch (the masked layout with a fixed max_m, which reads nothing back;
the contiguous layout up to its one host read). Value checks are off (TILECRAFT_CHECK_VALUES=0):
they sync. Timed with perf_counter around each call, the GPU drained every 50 calls. bench/NOTES.md "eager host cost" has the H200 host's
numbers.
"""

import statistics
import sys
import time

import torch

from tilecraft import env


def host_us(fn, n=300):
    """Median and min host microseconds of fn() (the queue drained every 50 calls)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    ts = []
    for i in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        if i % 50 == 49:
            torch.cuda.synchronize()
    return statistics.median(ts) * 1e6, min(ts) * 1e6


def cases(dev="cuda", gemm=True):
    import tvm_ffi

    import ops
    from codegen import targets
    from ops._workspace import bound_only
    from ops.gemm_fp8 import OUT_DTYPES, _launch, fp8_gemm_program, plan
    from ops.moe_dispatch import gather_rows_program
    from ops.moe_ep import _gather_into

    y = torch.randn(64, 7168, dtype=torch.bfloat16, device=dev)
    src = torch.arange(8, dtype=torch.int32, device=dev)
    out = torch.empty(8, 7168, dtype=torch.bfloat16, device=dev)
    t = targets.resolve(y)
    gather = gather_rows_program.compile(t, hidden=7168, bits="int16").launcher()
    yv, ov = y.view(torch.int16), out.view(torch.int16)
    small = torch.zeros(8, device=dev)
    res = {
        "torch add_ (1 launch)": lambda: small.add_(1),
        "torch.empty 8x7168": lambda: torch.empty(8, 7168, dtype=torch.bfloat16, device=dev),
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "tvm_ffi.from_dlpack, 1 tensor": lambda: tvm_ffi.from_dlpack(yv),
        "row gather: launcher, 3 tensors": lambda: gather(yv, src, ov),
        "row gather: moe_ep._gather_into": lambda: _gather_into(out, y, src),
    }
    for m, n, k in [(128, 4096, 7168), (128, 7168, 2048)] if gemm else []:
        g = torch.Generator().manual_seed(0)
        qa, sfa = ops.per_token_group_quant_fp8(torch.randn(m, k, generator=g).to(dev))
        qb, sfb = ops.per_block_quant_fp8(torch.randn(n, k, generator=g).to(dev))
        o = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
        aux = torch.empty(m, dtype=torch.int32, device=dev), torch.empty(1, dtype=torch.int32, device=dev)
        p = plan("dense", m, n, k, 128)
        kern = fp8_gemm_program.compile(t, n=n, k=k, mode="dense", out_dtype=OUT_DTYPES[o.dtype], **p).launcher()
        part = (torch.empty(p["splits"], m, n, dtype=torch.float32, device=dev) if p["splits"] > 1
                else torch.empty(1, 1, n, dtype=torch.float32, device=dev))
        name = f"fp8 gemm {m}x{n}x{k} (splits {p['splits']})"
        res[f"{name}: ops.fp8_gemm_nt"] = lambda a=(qa, sfa, qb, sfb): ops.fp8_gemm_nt(*a)
        res[f"{name}: _launch"] = lambda a=(qa, sfa, qb[None], sfb[None], *aux, o, n, k): _launch("dense", *a)
        count = bound_only(dev)                 # the fold's arrival counters: bound, unused by these plans
        res[f"{name}: kernel launcher"] = lambda a=(qa, sfa, qb[None], sfb[None], *aux, o, part, count), kern=kern: kern(*a)
    for m, n, k in [(1, 7168, 2048), (64, 4096, 7168)] if gemm else []:
        # the MXFP4 op (the swapped register-decode kernel at these m) next to torch's bf16 GEMM of the shape
        g = torch.Generator().manual_seed(0)
        w = torch.randn(n, k, generator=g)
        b, sfb = (t_.to(dev) for t_ in ops.quant_mxfp4(w))
        a, wb = torch.randn(m, k, generator=g).to(dev, torch.bfloat16), w.to(dev, torch.bfloat16)
        res[f"mxfp4 gemm {m}x{n}x{k}: ops.mxfp4_gemm_nt"] = lambda a=a, b=b, sfb=sfb: ops.mxfp4_gemm_nt(a, b, sfb)
        res[f"mxfp4 gemm {m}x{n}x{k}: torch bf16 a @ w.t()"] = lambda a=a, wb=wb: a @ wb.t()
    res.update(topk_and_dispatch_cases(dev))
    return res


def topk_and_dispatch_cases(dev="cuda"):
    import ops
    from ops import topk_sliced
    from ops._workspace import int32_views
    from ops.moe_dispatch import _plan_queued, _scatter_rows

    res = {}
    for R, N, k in [(64, 131072, 2048), (128, 65536, 512)]:
        s = torch.randn(R, N, device=dev)
        lengths = torch.full((R,), N, dtype=torch.int32, device=dev)
        res[f"topk_select {R}x{N} k={k}"] = lambda a=(s, k, lengths): ops.topk_select(a[0], a[1], lengths=a[2])
    shapes = [(64, c) for c in (topk_sliced.NB, 8, 8 * 2048, 131072, 131072, 131072, 131072)]
    res["topk scratch: int32_views, 7 views"] = lambda: int32_views(dev, *shapes)
    T, H, E, k = 4096, 7168, 256, 8
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int().to(dev)
    res[f"moe_dispatch masked max_m=512 (T={T}, H={H}, k={k})"] = lambda: ops.moe_dispatch(
        x, ids, E, layout="masked", max_m=512)

    def contiguous_until_read():
        mapping, src, rows, pending = _plan_queued(ids, E, "contiguous", 128, None)
        return _scatter_rows(x, mapping.positions, src, rows, True, pending[1])

    res["moe_dispatch contiguous align=128, up to its host read"] = contiguous_until_read
    return res


def main():
    if not torch.cuda.is_available():
        sys.exit("bench.host_cost needs a CUDA GPU: it times host paths that launch kernels")
    env.set("TILECRAFT_CHECK_VALUES", "0")           # value checks sync: they would time the GPU
    print(f"torch {torch.__version__}, __dlpack_c_exchange_api__ on torch.Tensor: "
          f"{hasattr(torch.Tensor, '__dlpack_c_exchange_api__')}, GPU {torch.cuda.get_device_name()}")
    only = sys.argv[1:]     # substrings: time only the cases whose name holds one of them
    gemms = not only or any(w in o for o in only for w in ("gemm", "fp8", "mxfp4", "torch bf16"))
    for name, fn in cases(gemm=gemms).items():
        if only and not any(o in name for o in only):
            continue
        med, mn = host_us(fn)
        print(f"{name:52s} host median {med:7.1f} us  min {mn:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
