"""Codegen: the portable tile vocabulary (codegen.tile), the lowering-rule registry
(codegen.rules), targets (codegen.targets), tile programs (codegen.program) and the JIT with its
memory + disk cache (codegen.jit, codegen.cache). `python -m codegen.show` and
`python -m codegen.warmup` are the command-line tools.
"""

from backends.cuda.toolchain import prepare_tilelang_env as _prepare

_prepare()  # TileLang reads CUDA_HOME once, when first imported: point it at our nvcc first
