"""PyTorch's own DDP tests (``torch.testing._internal.distributed.distributed_test``, shipped in the
torch wheel) with our lossless hook registered on every DDP model they build.

Run by tests/test_torch_ddp_suite.py as ``python tests/torch_ddp/suite.py TestName ...`` with
BACKEND=gloo, WORLD_SIZE=2, TEMP_DIR set. Each rank is a process spawned by torch's harness, which
re-imports this module, so the patch below is in force on every rank.
"""
import json
import os
import sys

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lossless_hc.plugins.ddp import LosslessHookState, lossless_hook  # noqa: E402
from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

_original_init = DistributedDataParallel.__init__


def _init_with_lossless_hook(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    # The tests' gradients are dense. At a capacity of 5% of each tensor, the tensors of 500 elements
    # and more (smaller ones are sent as they are) go through the codec, every rank over capacity:
    # the codec's encode, an OVERLOADED decode and the exact dense fallback, after which the grown
    # capacity sends the tensor as it is. (At 1.0, as before 2026-12-01, no tensor reached the codec.)
    state = LosslessHookState(process_group=self.process_group, max_density=0.05)
    self.register_comm_hook(state, _recorded_lossless_hook)


def _recorded_lossless_hook(state, bucket):
    """``lossless_hook``, and after each bucket this rank's counters of the state in
    ``$LHC_HOOK_STATS_DIR`` (read by tests/test_torch_ddp_suite.py: the hook ran, through the codec)."""
    def record(fut):
        counters = {k: v for k, v in state.stats().items() if isinstance(v, (int, float))}
        path = os.path.join(os.environ["LHC_HOOK_STATS_DIR"], f"hook.{os.getpid()}.{id(state)}.json")
        with open(path, "w") as f:
            json.dump(counters, f)
        return fut.value()
    return lossless_hook(state, bucket).then(record)


DistributedDataParallel.__init__ = _init_with_lossless_hook


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    assert dist.is_available()
    run_tests()
