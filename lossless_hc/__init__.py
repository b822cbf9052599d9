"""lossless_hc: homomorphic gradient compression for data-parallel PyTorch training.

    import lossless_hc as lhc
    codec = lhc.LosslessCodec(numel=d, world_size=n, max_nnz=k, block_size=1, seed=0, device="cpu")
    payload = codec.encode(x)            # 1-D float32, codec.payload_numel elements, same on all ranks
    y, report = codec.decode(summed)     # summed: element-wise SUM of all ranks' payloads

    thc = lhc.THCCodec(numel=d, world_size=n, rank=r, bits=4, granularity=30)   # dense gradients, lossy
    payload = thc.encode(g)              # 1-D float64, thc.payload_numel elements
    avg = thc.decode(averaged_payload, averaged=True)
"""
from .codec import DecodeReport, LosslessCodec
from .layout import PayloadLayout, plan_layout, sketch_table_for
from . import thc
from .thc import THCCodec

__all__ = ["LosslessCodec", "DecodeReport", "PayloadLayout", "plan_layout", "sketch_table_for", "THCCodec", "thc"]
__version__ = "0.1.0"
