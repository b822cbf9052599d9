"""DDP's auto_hook in one process (a Gloo world of one): a plain step's future only notes when its sum arrived
and the aggregators account it on the main thread later (plugins/ddp.py, AutoHookState._record_plain_steps):
at the next hook call, stats() or pickling. The multi-process runs are in tests/test_planner_mp.py."""
import pickle

import torch
from torch.nn.parallel import DistributedDataParallel

from lossless_hc.plugins.ddp import AutoHookState, auto_hook


def _counts(state):
    return {name: (p["steps"], p["plain_steps"], p["bytes_sent"]) for name, p in state.stats()["plan"].items()}


def test_a_state_pickled_right_after_a_plain_step_keeps_its_accounting(gloo_world_of_one):
    """A state pickled (as torch.save(ddp_model) pickles it) right after a step whose buckets went plain, before
    anything else read its counts: the restored state counts that step as the state that goes on does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    ddp = DistributedDataParallel(model)
    state = AutoHookState()
    ddp.register_comm_hook(state, auto_hook)
    for _ in range(3):   # the first step carries the statistics; the next two are plain
        ddp.zero_grad()
        ddp(torch.randn(5, 16)).sum().backward()
    restored = pickle.loads(pickle.dumps(state))
    counts = _counts(state)
    assert len(counts) == 4 and {(steps, plain) for steps, plain, _ in counts.values()} == {(3, 2)}, counts
    assert _counts(restored) == counts
