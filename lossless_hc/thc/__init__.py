"""THC, tensor homomorphic compression of dense gradients (lossy, unbiased).

    table   the quantization tables (build_table, table_for) and the shipped tables.json
    layout  the payload layout and its exactness limits (plan_thc_layout, max_world_size)
    codec   THCCodec: encode, decode, error feedback
"""
from lossless_hc.thc.codec import THCCodec
from lossless_hc.thc.layout import THCLayout, max_world_size, plan_thc_layout
from lossless_hc.thc.table import (PUBLISHED_TABLE_4BIT_G30_P32, THCTable, build_table, clip_threshold, table_for,
                                   table_variance)

__all__ = ["THCCodec", "THCLayout", "THCTable", "build_table", "table_for", "table_variance", "clip_threshold",
           "PUBLISHED_TABLE_4BIT_G30_P32", "max_world_size", "plan_thc_layout"]
