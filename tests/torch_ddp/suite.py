"""PyTorch's own DDP tests (``torch.testing._internal.distributed.distributed_test``, shipped in the
torch wheel) with our lossless hook registered on every DDP model they build.

Run by tests/test_torch_ddp_suite.py as ``python tests/torch_ddp/suite.py TestName ...`` with
BACKEND=gloo, WORLD_SIZE=2, TEMP_DIR set. Each rank is a process spawned by torch's harness, which
re-imports this module, so the patch below is in force on every rank.
"""
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
    # Dense tests gradients are dense: max_density 1.0 keeps every tensor on the compressed path
    # where it fits and lets the rest fall back densely, exactly.
    state = LosslessHookState(process_group=self.process_group, max_density=1.0)
    self.register_comm_hook(state, lossless_hook)
    HOOKED.append(state)


HOOKED = []
DistributedDataParallel.__init__ = _init_with_lossless_hook


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    assert dist.is_available()
    run_tests()
