"""lossless_hc: homomorphic gradient compression for data-parallel PyTorch training.

Layers, each importing only those below it (docs/DESIGN.md, "Layers"): ``lhc`` and ``thc`` (the
codecs) over ``backends`` (CPU and CUDA kernels, one seam); ``training`` (aggregation policy);
``lossless_hc.plugins`` (engine adapters); ``bench`` (benchmarks and workloads).

    import lossless_hc as lhc
    codec = lhc.LosslessCodec(numel=d, world_size=n, max_nnz=k, block_size=1, seed=0, device="cpu")
    payload = codec.encode(x)            # 1-D float32, codec.payload_numel elements, same on all ranks
    y, report = codec.decode(summed)     # summed: element-wise SUM of all ranks' payloads

    thc = lhc.THCCodec(numel=d, world_size=n, rank=r, bits=4, granularity=30)   # dense gradients, lossy
    payload = thc.encode(g)              # 1-D float64, thc.payload_numel elements
    avg = thc.decode(averaged_payload, averaged=True)
"""
from lossless_hc import thc
from lossless_hc.lhc.codec import DecodeReport, LosslessCodec
from lossless_hc.lhc.cost_model import plan_layout
from lossless_hc.lhc.layout import PayloadLayout
from lossless_hc.lhc.sizing import sketch_table_for
from lossless_hc.lhc.status import DecodeStatus
from lossless_hc.thc import THCCodec
from lossless_hc.training.capacity import CapacityPolicy

__all__ = ["LosslessCodec", "DecodeReport", "DecodeStatus", "PayloadLayout", "plan_layout", "sketch_table_for",
           "THCCodec", "thc", "CapacityPolicy"]
__version__ = "0.1.0"
