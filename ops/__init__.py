"""Tilecraft's public operators. Every op is a torch custom op (tilecraft::name) with a fake
implementation, validates its inputs, and runs the kernel lowered for the tensors' device."""

from ops.gemm_mxfp4 import m_grouped_mxfp4_gemm_nt_contiguous, m_grouped_mxfp4_gemm_nt_masked, mxfp4_gemm_nt
from ops import gemm_mxfp4_native  # noqa: F401  (registers the block-scaled programs)
from ops.gemm_w4a8 import (dequant_w4a8, m_grouped_mxfp4_w4a8_gemm_nt_contiguous, m_grouped_mxfp4_w4a8_gemm_nt_masked,
                           mxfp4_w4a8_gemm_nt, prepare_mxfp4_w4a8, w4a8_exact)
from ops.gemm_fp8 import (fp8_gemm_nt, m_grouped_fp8_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_masked,
                          m_grouped_fp8_gemm_nt_sorted)
from ops.quant import (dequant_fp8_blocks, dequant_fp8_token_groups, dequant_mx_fp8, dequant_mxfp4,
                       per_block_quant_fp8, per_token_group_quant_fp8, quant_mxfp4)
from ops.mla_decode import (MlaSchedule, dequantize_mla_kv_fp8, get_mla_schedule, mla_decode, mla_decode_reference,
                            quantize_mla_kv_fp8)
from ops.eplb import EplbPlan, eplb_plan
from ops.moe_dispatch import EpMapping, MoeMapping, moe_combine, moe_dispatch
from ops import moe_ep  # noqa: F401  (the expert-parallel path and its tile program)
from ops import moe_ep_peer  # noqa: F401  (its peer-memory transport and its tile program)
from ops.moe_tiles import moe_tile_items
from ops.moe_route import moe_hash_route, moe_route, moe_route_reference
from ops.rms_norm import rms_norm, rms_norm_reference
from ops.topk_select import topk_select, topk_select_reference

__all__ = ["rms_norm", "rms_norm_reference", "mla_decode", "mla_decode_reference", "get_mla_schedule", "MlaSchedule",
           "quantize_mla_kv_fp8", "dequantize_mla_kv_fp8",
           "moe_route", "moe_route_reference", "moe_hash_route", "moe_dispatch", "moe_combine", "MoeMapping", "EpMapping",
           "moe_tile_items",
           "eplb_plan", "EplbPlan",
           "topk_select", "topk_select_reference",
           "fp8_gemm_nt", "mxfp4_gemm_nt", "mxfp4_w4a8_gemm_nt", "m_grouped_mxfp4_w4a8_gemm_nt_masked",
           "m_grouped_mxfp4_w4a8_gemm_nt_contiguous", "prepare_mxfp4_w4a8", "dequant_w4a8", "w4a8_exact",
           "m_grouped_mxfp4_gemm_nt_contiguous", "m_grouped_mxfp4_gemm_nt_masked",
           "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked",
           "m_grouped_fp8_gemm_nt_sorted",
           "per_token_group_quant_fp8", "per_block_quant_fp8", "quant_mxfp4",
           "dequant_fp8_token_groups", "dequant_fp8_blocks", "dequant_mxfp4", "dequant_mx_fp8"]
