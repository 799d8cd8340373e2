"""TileLang's C target (run through the cython backend): one thread per block, thread-private
buffers, loops run serially. It has no bf16 type, so bf16 tensors are carried as uint16 and
converted by bit arithmetic (round to nearest even on the way out)."""

import tilelang.language as T

from codegen.rules import register
from codegen.tile import Accumulator, state


@register("grid", "cpu")
def grid(blocks, threads=128):
    state()["threads"] = 1
    return T.Kernel(blocks, threads=1)


@register("fragment", "cpu")
def fragment(shape, dtype="float32"):
    return T.alloc_local(shape, dtype)


@register("stage", "cpu")
def stage(shape, dtype):
    return T.alloc_local(shape, dtype)


@register("operand", "cpu")
def operand(shape, dtype):
    return T.alloc_local(shape, dtype)


@register("accumulator", "cpu")
def accumulator(shape, dtype="float32"):
    return Accumulator(T.alloc_local(shape, dtype), tuple(shape), dtype)


@T.macro
def _mma_serial(a, b, c, transpose_b, clear, dtype):
    if clear:
        T.clear(c)
    for i, j, k in T.grid(c.shape[0], c.shape[1], a.shape[1]):
        if transpose_b:
            c[i, j] += to_f32(a[i, k], dtype) * to_f32(b[j, k], dtype)
        else:
            c[i, j] += to_f32(a[i, k], dtype) * to_f32(b[k, j], dtype)


@register("mma", "cpu")
def mma(a, b, acc, transpose_b=True, clear=False, step=0):
    if str(a.dtype) in ("float32", "float16") and str(a.dtype) == str(b.dtype):
        return T.gemm(a, b, acc.buf, transpose_B=transpose_b, clear_accum=clear)
    return _mma_serial(a, b, acc.buf, transpose_b, clear, "bfloat16" if str(a.dtype) == "uint16" else str(a.dtype))


@register("limits", "cpu")
def limits():
    return {"smem_bytes": None, "accumulator_columns": None, "sms": 1}


@T.macro
def _scale_rows(c, row_scale, step):
    if step > 0:
        for i, j in T.grid(c.shape[0], c.shape[1]):
            c[i, j] *= row_scale[i]
    else:
        T.clear(c)


@register("mma_rescaled", "cpu")
def mma_rescaled(a, b, acc, row_scale, transpose_b=False, step=0):
    _scale_rows(acc.buf, row_scale, step)
    return mma(a, b, acc, transpose_b=transpose_b, clear=False)


@register("read_accumulator", "cpu")
def read_accumulator(acc):
    return acc.buf


@register("parallel", "cpu")
def parallel(*extents):
    return T.grid(*extents)


@register("pipelined", "cpu")
def pipelined(n, stages=2):
    return T.serial(n)


@T.macro
def _cumsum_1d(src, dst, n):
    dst[0] = src[0]
    for i in T.serial(1, n):
        dst[i] = dst[i - 1] + src[i]


@register("cumsum", "cpu")
def cumsum(src, dst=None, dim=0):
    # TileLang's C target has no tl.cumsum: a serial loop (1-D tiles)
    if len(src.shape) != 1 or dim != 0:
        raise ValueError(f"cumsum on the cpu target handles 1-D tiles only, got shape {tuple(src.shape)}, dim={dim}")
    return _cumsum_1d(src, src if dst is None else dst, src.shape[0])


@register("storage_dtype", "cpu")
def storage_dtype(dtype):
    return "uint16" if str(dtype) == "bfloat16" else dtype


@register("to_f32", "cpu")
def to_f32(x, dtype):
    if str(dtype) == "bfloat16":
        return T.reinterpret(T.shift_left(T.cast(x, "uint32"), T.uint32(16)), "float32")
    return T.cast(x, "float32")


@register("from_f32", "cpu")
def from_f32(x, dtype):
    if str(dtype) == "bfloat16":
        bits = T.reinterpret(x, "uint32")
        rounded = bits + T.uint32(0x7FFF) + ((bits >> T.uint32(16)) & T.uint32(1))
        is_nan = (bits & T.uint32(0x7FFFFFFF)) > T.uint32(0x7F800000)
        return T.cast(T.if_then_else(is_nan, T.uint32(0x7FC0), rounded >> T.uint32(16)), "uint16")
    return T.cast(x, dtype)


@register("barrier", "cpu")
def barrier():
    return T.evaluate(0)  # one thread per block: nothing to wait for
