"""The training policy, engine-independent: per-tensor aggregators (dense or compressed, capacity,
error feedback), the capacity policy, and the compressor core that the engine adapters
(``lossless_hc.plugins``) wrap."""
