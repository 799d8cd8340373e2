"""The L2 promotion of the TMA descriptors a kernel's host code builds (CUDA).

TileLang 0.1.15 builds every tiled descriptor with CU_TENSOR_MAP_L2_PROMOTION_L2_128B: an L2 miss of
a TMA load fetches the 128 bytes it asked for. With L2_256B (what DeepGEMM and FlashMLA use) a miss
fetches the aligned 256 bytes around it, so a K-major tile whose rows are 128 bytes (one FP8 K block)
brings the next K block of those rows into the L2 with it: half the DRAM round trips a stream waits
on. At 128x4096x7168 our FP8 GEMM ran 15.5 us at ncu's locked 1.29 GHz and 15.2 us at ~1.98 GHz,
DeepGEMM's with the same tiles 17.1 and 12.9 (bench/NOTES.md "Session 32"): ours was bound by
something outside the SM clock, and this is where the two kernels' descriptors differ (same boxes,
same 128-byte swizzle).

L2_PROMOTION (bytes: 0, 64, 128 or 256) is applied to the host module before TileLang generates its
host code (`install`, called by codegen.jit), is part of the compile cache key, and is a declared
switch (codegen.rules.options): setting it at run time builds new kernels. It is TileLang's own 128
until 256 has run on a GPU: built and CPU-checked in session 32 after that session's GPU time; the
bench providers `tilecraft-l2-256` (gemm, mla) time it beside the default.
"""

from codegen import rules

L2_PROMOTION = 128
_CODES = {0: 0, 64: 1, 128: 2, 256: 3}    # CUtensorMapL2promotion
_CREATE_TILED = "__tvm_tensormap_create_tiled"

rules.options(__name__, "L2_PROMOTION")


def code(nbytes: int) -> int:
    if nbytes not in _CODES:
        raise ValueError(f"L2_PROMOTION must be one of {sorted(_CODES)} (bytes), got {nbytes!r}")
    return _CODES[nbytes]


def promote(host_mod, nbytes: int):
    """host_mod with every tiled TMA descriptor's L2 promotion set to `nbytes` (the create call's
    second-to-last argument: ..., interleave, swizzle, l2 promotion, oob fill). The functions'
    "tma_descriptor_args" attribute keeps TileLang's value: only its cython and nvrtc wrappers read it,
    and codegen.jit builds CUDA kernels with tvm_ffi, whose host code is generated from these calls."""
    import tvm
    from tvm import tirx
    from tvm.tirx.stmt_functor import ir_transform

    value = code(nbytes)

    def post(node):
        if (isinstance(node, tirx.Call) and node.args and isinstance(node.args[0], tirx.StringImm)
                and node.args[0].value == _CREATE_TILED):
            args = list(node.args)
            args[-2] = tirx.IntImm(args[-2].dtype, value)
            return tirx.Call(node.dtype, node.op, args, node.span)
        return None

    funcs = {gv: func.with_body(ir_transform(func.body, None, post, ["tirx.Call"]))
             if isinstance(func, tirx.PrimFunc) else func for gv, func in host_mod.functions.items()}
    return tvm.IRModule(funcs, attrs=host_mod.attrs, global_infos=host_mod.global_infos)


def install() -> None:
    """Wrap TileLang's host code generation so that it applies L2_PROMOTION (read at each compile)."""
    import importlib

    tl_lower = importlib.import_module("tilelang.engine.lower")    # (tilelang.engine.lower is also a function)
    if getattr(tl_lower.host_codegen, "tilecraft_l2", False):
        return
    original = tl_lower.host_codegen

    def host_codegen(host_mod, *args, **kwargs):
        if L2_PROMOTION != 128:
            host_mod = promote(host_mod, L2_PROMOTION)
        return original(host_mod, *args, **kwargs)

    host_codegen.tilecraft_l2 = True
    tl_lower.host_codegen = host_codegen
