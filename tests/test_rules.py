"""The rule registry, and proof that rules a kernel author adds are the ones used."""

import pytest
import tilelang.language as T
import torch

import ops
from codegen import rules, tile
from codegen.program import TileProgram
from codegen.rules import NoRuleError


def test_lookup_prefers_exact_then_vendor_then_any():
    assert rules.lookup("accumulator", "sm_90a").pattern == "cuda:sm_90a"
    assert rules.lookup("fragment", "sm_100a").pattern == "cuda"
    assert rules.lookup("copy", "sm_90a").pattern == "*"
    assert rules.lookup("copy", "ascend").pattern == "ascend"


def test_every_word_lowers_on_every_target():
    for word in ("grid", "vector", "persistent", "fragment", "stage", "operand", "accumulator", "mma",
                 "read_accumulator", "store", "copy", "parallel", "pipelined", "row_reduce", "storage_dtype", "to_f32", "from_f32"):
        for t in ("sm_90a", "sm_100a", "ascend", "cpu"):
            assert callable(rules.lookup(word, t).fn)


def test_duplicate_registration_needs_replace():
    with pytest.raises(ValueError, match="already registered.*replace=True"):
        rules.register("mma", "sm_90a", lambda *a, **k: None)


def test_unknown_word_and_missing_rule_are_clear():
    with pytest.raises(NoRuleError, match="'warp_shuffle' is not a tile word"):
        rules.lookup("warp_shuffle", "cpu")
    rules.register("only_on_ascend", "ascend", lambda: None)
    try:
        with pytest.raises(NoRuleError, match=r"no lowering rule for tile word 'only_on_ascend' on cuda:sm_90a \(rules exist for: ascend\)"):
            rules.lookup("only_on_ascend", "sm_90a")
    finally:
        rules.unregister("only_on_ascend", "ascend")


def test_bad_registrations_rejected():
    with pytest.raises(ValueError, match="identifier"):
        rules.register("not a word", "cpu", lambda: None)
    with pytest.raises(ValueError, match="unknown target"):
        rules.register("mma", "sm_75", lambda: None)
    with pytest.raises(TypeError, match="callable"):
        rules.register("mma", "cuda:sm_100a", 3, replace=True)


def test_override_restores_previous_rule():
    before = rules.lookup("from_f32", "cpu").fn
    gen = rules.generation()
    with rules.override("from_f32", "cpu", lambda x, dtype: x):
        assert rules.lookup("from_f32", "cpu").fn is not before
        assert rules.generation() > gen
    assert rules.lookup("from_f32", "cpu").fn is before


def test_overridden_rule_changes_the_compiled_kernel():
    """An author's rule for an existing word is used by an op that never mentions it."""
    x = torch.randn(4, 256)
    w = torch.randn(256)
    base = ops.rms_norm(x, w)

    def doubled_from_f32(value, dtype):
        return T.cast(value * 2.0, dtype)

    with rules.override("from_f32", "cpu", doubled_from_f32):
        changed = ops.rms_norm(x, w)
    torch.testing.assert_close(changed, 2 * base)
    torch.testing.assert_close(ops.rms_norm(x, w), base)  # the old kernel is back, not the overridden one


# -- a new word, added from outside codegen, used by a new program -----------------------------------

def _softcap_any(x, cap):
    return T.tanh(x / cap) * cap


def _softcap_builder(n: int, cap: float = 30.0):
    @T.prim_func
    def softcap(X: T.Tensor((n,), "float32"), Y: T.Tensor((n,), "float32")):
        with tile.grid(1, 128) as _:
            with tile.vector():
                for i in tile.parallel(n):
                    Y[i] = tile.softcap(X[i], cap)

    return softcap


def test_author_added_word_is_used():
    rules.register("softcap", "*", _softcap_any, doc="cap * tanh(x / cap)")
    try:
        prog = TileProgram("test_softcap", _softcap_builder)
        x = torch.randn(64) * 100
        y = torch.empty_like(x)
        prog.compile("cpu", n=64)(x, y)
        torch.testing.assert_close(y, 30 * torch.tanh(x / 30))
        assert "tanh" in prog.source("sm_90a", n=64)
        assert "softcap" in rules.words()
    finally:
        rules.unregister("softcap", "*")
    with pytest.raises(AttributeError, match="no word 'softcap'"):
        tile.softcap


def test_split_index_is_row_major():
    assert tile.split_index(7, (2, 3, 4)) == (0, 1, 3)
    assert tile.split_index(23, (2, 3, 4)) == (1, 2, 3)


def test_cuda_barrier_takes_a_group_of_its_own():
    """tile.barrier(threads=, group=g) on CUDA: a named barrier of threads g * threads .. (one MMA warpgroup of two,
    as the persistent MLA epilogue stages its output), on an id of its own per group; a group without threads=, a
    group past the two, or threads that are not whole warps name what they need."""
    barrier = rules.lookup("barrier", "sm_90a").fn
    ids = {g: str(barrier(threads=128, group=g)) for g in (0, 1)}
    assert all(", 128)" in text for text in ids.values()) and ids[0] != ids[1]
    assert str(barrier(threads=128)) == ids[0] and "128" not in str(barrier())
    for bad, match in ((dict(group=1), "group must be 0 .. 1 .*got group=1, threads=None"),
                       (dict(threads=128, group=2), "group must be 0 .. 1"),
                       (dict(threads=100), "threads must be whole warps")):
        with pytest.raises(ValueError, match=match):
            barrier(**bad)
