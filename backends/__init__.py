"""Vendor toolchains: finding compilers, building binaries, inspecting them, launching.

`backends.cuda` (CUDA 13: sm_90a, sm_100a) and `backends.ascend` (CANN 9.2: Ascend 950).
Nothing here knows about operators; codegen calls in, ops never do.
"""


class ToolchainError(RuntimeError):
    """A compiler, disassembler, driver or device that a step needs is missing or unusable."""
