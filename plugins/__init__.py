"""Framework adapters (installed as ``lossless_hc.plugins``): thin translations of the engines'
compression hooks onto the codecs in ``lossless_hc``. No algorithm lives here."""
