"""bench.model_qreg_protocol: the barrier protocols of the two MLA kernels with Q in registers, over random
interleavings of their roles and TMA landings, find no deadlock, no wait passing on the wrong phase and no slot
read or written out of turn at the kernels' ring sizes, and do find them where the rings are too shallow."""

from bench.model_qreg_protocol import bf16_protocol, failures, fp8_protocol
from ops.mla_decode_fp8_qreg import AHEAD, RAW_RING, RING
from ops.mla_decode_qreg import RING as BF16_RING


def test_the_kernels_rings_pass():
    assert failures(bf16_protocol, 12, 40, ring=BF16_RING) == []
    assert failures(bf16_protocol, 8, 40, ring=2) == []
    assert failures(fp8_protocol, 12, 40, raw_ring=RAW_RING, ring=RING, ahead=AHEAD) == []


def test_too_shallow_rings_are_caught():
    # converters as far ahead as the converted ring is deep: they overwrite a slot WG0 or the other still reads
    bad = failures(fp8_protocol, 8, 10, raw_ring=RAW_RING, ring=3, ahead=3)
    assert bad and any("writes" in m or "reads" in m for *_, m in bad)
    # a raw ring no deeper than the converters run ahead: the step they wait for is never loaded
    bad = failures(fp8_protocol, 8, 5, raw_ring=2, ring=3, ahead=2)
    assert bad and any("deadlock" in m for *_, m in bad)
