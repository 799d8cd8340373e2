"""Ascend backend (CANN 9.2, Ascend 950 / dav-3510): Ascend C source generation works anywhere;
compiling needs CANN's `bisheng`, launching needs torch_npu."""

from backends.ascend.toolchain import bisheng_version, find_bisheng, require_npu

__all__ = ["bisheng_version", "find_bisheng", "require_npu"]
