"""The CPU backend's Python side (lossless_hc.backends.cpu) at its edges: what its argument checks take and
refuse before a kernel sees an address, and the clear error of an install without the C++ kernels."""
import pytest
import torch

from lossless_hc.backends import backend_for, cpu

CPU = backend_for(torch.device("cpu"))


@pytest.mark.parametrize("call", [
    pytest.param(lambda: cpu.decode_statuses(), id="decode_statuses"),
    pytest.param(lambda: cpu.thc_cpu_isa(), id="thc_cpu_isa"),
    pytest.param(lambda: cpu.thc_cpu_isas(), id="thc_cpu_isas"),
    pytest.param(lambda: cpu.lhc_peel_batch(), id="lhc_peel_batch"),
    pytest.param(lambda: CPU.require(torch.device("cpu"), "LosslessCodec"), id="require"),
])
def test_without_the_extension_each_entry_point_says_how_to_build_it(monkeypatch, call):
    """An install whose lossless_hc._C failed to import: every entry point that needs the kernels raises the
    ImportError naming the build step (not an AttributeError on None from deep inside)."""
    monkeypatch.setattr(cpu, "_C", None)
    with pytest.raises(ImportError, match=r"lossless_hc\._C \(the C\+\+ kernels\) is not built; run `make build`"):
        call()
