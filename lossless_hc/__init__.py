"""lossless_hc: homomorphic gradient compression for data-parallel PyTorch training.

    import lossless_hc as lhc
    codec = lhc.LosslessCodec(numel=d, world_size=n, max_nnz=k, block_size=1, seed=0, device="cpu")
    payload = codec.encode(x)            # 1-D float32, codec.payload_numel elements, same on all ranks
    y, report = codec.decode(summed)     # summed: element-wise SUM of all ranks' payloads
"""
from .codec import DecodeReport, LosslessCodec
from .layout import PayloadLayout, plan_layout, sketch_table_for

__all__ = ["LosslessCodec", "DecodeReport", "PayloadLayout", "plan_layout", "sketch_table_for"]
__version__ = "0.1.0"
