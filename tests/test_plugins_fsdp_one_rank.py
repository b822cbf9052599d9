"""FSDP2 plugin, one rank in this process (a Gloo world of one, a 1x1 or 1-D mesh; no launch): the option
checks of the states and of register(), load_state_dict before register, the division on a mesh of one rank,
and the reduce-scatters' parameter slots. The training scenarios on 2x2, 1x2 and 2x1 meshes of real ranks are
tests/test_plugins_fsdp.py.
"""
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lossless_hc.plugins._fsdp_reduce_scatter import (HomomorphicReduceScatter, RowExchangeReduceScatter,
                                                     SelectionRowExchangeReduceScatter, Slots)
from lossless_hc.plugins.fsdp import LosslessFSDPState, THCFSDPState, TopKFSDPState
from lossless_hc.training.capacity import CapacityPolicy

pytestmark = pytest.mark.multiprocess   # with the launched tests: each test makes this process a Gloo rank


@pytest.fixture
def world_of_one(tmp_path):
    """This process as the one rank of a Gloo world, for the test's duration."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_register_checks_its_options(world_of_one):
    """register(reduce_scatter="no") compressed the reduce-scatter (a truthy string), and a
    gradient_divide_factor of 0, NaN or inf gave inf/NaN gradients: both refused before any hook is
    installed (one rank, a 1x1 mesh, no launch), as is a CapacityPolicy that would size nothing."""
    state = LosslessFSDPState(init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="reduce_scatter must be a bool"):
        state.register(model, reduce_scatter="no")
    for bad in (0, -2.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match="gradient_divide_factor"):
            state.register(model, reduce_scatter=True, gradient_divide_factor=bad)
    with pytest.raises(ValueError, match="fully_shard"):   # the options pass: the model is refused next
        state.register(model, reduce_scatter=True, gradient_divide_factor=2.0)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    policy = CapacityPolicy(interval=2)
    with pytest.raises(ValueError, match="homomorphic reduce-scatter gives to the owner alone"):
        LosslessFSDPState(mesh, policy=policy).register(model, reduce_scatter=True)
    with pytest.raises(ValueError, match="this mesh has no replicas"):   # top-k's: nothing to size here
        TopKFSDPState(mesh, policy=policy).register(model, reduce_scatter=True)


def test_register_refuses_a_mesh_with_nothing_to_compress_and_takes_any_positive_factor(world_of_one):
    """register() without reduce_scatter (its default) on a mesh without replicas would install no hook at
    all: refused, naming the fix; THC asked for the reduce-scatter (its norm agreement needs every decoded
    aggregate) and a mesh of 3 dimensions (or none) likewise; a gradient_divide_factor in (0, 1] is a
    finite positive number and passes (one rank, a 1x1 mesh, no launch)."""
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    model = torch.nn.Linear(2, 2)
    for state in (LosslessFSDPState(mesh), LosslessFSDPState(init_device_mesh("cpu", (1,)))):
        with pytest.raises(ValueError, match="has no replica all-reduce to compress; pass reduce_scatter=True"):
            state.register(model)
    for factor in (0.5, 1, 1.0):   # the options pass: the model is refused next
        with pytest.raises(ValueError, match="fully_shard"):
            LosslessFSDPState(mesh).register(model, reduce_scatter=True, gradient_divide_factor=factor)
    with pytest.raises(ValueError, match="THCFSDPState cannot compress the reduce-scatter"):
        THCFSDPState(mesh).register(model, reduce_scatter=True)
    for bad in (init_device_mesh("cpu", (1, 1, 1)), "mesh", None):
        with pytest.raises(ValueError, match="mesh must be a 1-D"):
            LosslessFSDPState(bad)


def test_load_state_dict_refuses_another_state_s_file_before_register(world_of_one):
    """load_state_dict takes only a state_dict() of the same configuration (another density, another
    algorithm: the error feedback and capacities would mean something else) whose tables are dicts, and
    checks a sparse reduce-scatter's saved cadence as it loads, before any model is registered: ``calls``
    an int >= 0 (0 included: saved before that module's first reduce-scatter), ``all_whole`` a bool,
    ``interval`` absent, None or an int >= 1
    (one rank, a 1x1 mesh, no launch). What it loaded before register that the registered model lacks
    (a parameter, a module reduce-scattered by a hook) is refused by register, as a ValueError."""
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    saved = LosslessFSDPState(mesh, max_density=0.01).state_dict()
    assert saved["rank"] == 0 and saved["aggregators"] == {} and saved["reduce_scatter"] == {}
    LosslessFSDPState(mesh, max_density=0.01).load_state_dict(saved)   # the same configuration: loads
    for other in (LosslessFSDPState(mesh, max_density=0.02), TopKFSDPState(mesh)):
        with pytest.raises(ValueError, match="the saved state was made by"):
            other.load_state_dict(saved)
    for bad in (None, [saved], dict(saved, aggregators=[]), {"config": saved["config"]}):
        with pytest.raises(ValueError, match="not a state_dict"):
            LosslessFSDPState(mesh, max_density=0.01).load_state_dict(bad)
    for cadence in ({"calls": 0, "all_whole": False}, {"calls": 3, "all_whole": True},
                    {"calls": 3, "all_whole": True, "interval": 32},
                    {"calls": 0, "all_whole": False, "interval": None}):
        LosslessFSDPState(mesh, max_density=0.01).load_state_dict(dict(saved, reduce_scatter={"users": cadence}))
    for cadence in ({"calls": -1, "all_whole": False}, {"calls": True, "all_whole": False},
                    {"calls": 1.0, "all_whole": False}, {"calls": 1, "all_whole": 1}, {"calls": 1}, [1, False],
                    {"calls": 1, "all_whole": True, "interval": 0}, {"calls": 1, "all_whole": True, "interval": True},
                    {"calls": 1, "all_whole": True, "interval": "16"},
                    {"calls": 1, "all_whole": True, "interval": 16.0}):
        state = LosslessFSDPState(mesh, max_density=0.01)
        with pytest.raises(ValueError, match="not a sparse reduce-scatter's state"):
            state.load_state_dict(dict(saved, reduce_scatter={"users": cadence}))
    # loaded before register, what the registered model lacks is refused there (the 1x1 mesh reduce-scatters
    # nothing with its hooks; the model has no parameter "nosuch")
    for table, error in (({"reduce_scatter": {"users": {"calls": 1, "all_whole": False}}},
                          "reduce-scatter states of modules this model does not reduce-scatter"),
                         ({"aggregators": {"replicate:nosuch->0": {}}},
                          "parameter\\(s\\) this model does not have")):
        state = LosslessFSDPState(mesh, max_density=0.01)
        state.load_state_dict(dict(saved, **table))
        model = torch.nn.Linear(2, 2)
        fully_shard(model, mesh=mesh["shard"])
        with pytest.raises(ValueError, match=error):
            state.register(model, reduce_scatter=True)


def test_a_one_rank_mesh_divides_as_native_fsdp2(world_of_one):
    """On a 1x1 mesh (reduce_scatter=True: no hook has anything to compress, none is installed) register()
    still hands gradient_divide_factor to FSDP2, which divides as it does natively with the same factor (torch 2.13
    divides a one-rank shard group's gradient twice; whatever it does, the same): the hook-less division
    of a shard group of one rank is the replica hook's only where there are replicas (one rank, no launch)."""
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    native, ours = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    ours.load_state_dict(native.state_dict())
    for m in (native, ours):
        fully_shard(m, mesh=mesh["shard"])
    native.set_force_sum_reduction_for_comms(True)
    native.set_gradient_divide_factor(4.0)
    state = LosslessFSDPState(mesh)
    state.register(ours, reduce_scatter=True, gradient_divide_factor=4.0)
    x = torch.randn(5, 4)
    for m in (native, ours):
        m(x).sum().backward()
    for a, b in zip(native.parameters(), ours.parameters()):
        assert torch.equal(a.grad.to_local(), b.grad.to_local()), (a.grad, b.grad)
    undivided = torch.ones(3, 1) * x.sum(0)   # d(sum(x W^T + b))/dW, before any division
    assert not torch.equal(ours.weight.grad.to_local(), undivided)
    # a shard group of one rank has nothing to reduce-scatter: no comm installed, nothing encoded
    assert state.stats()["tensors"] == 0 and state.state_dict()["aggregators"] == {}, state.stats()


def test_slots_name_and_cut_the_padded_shards_of_the_parameters_that_require_grad(world_of_one):
    """Slots: in fsdp_params order, each parameter that requires grad, named by its FQN once FSDP2 has
    set it (the first forward; the aggregators' and checkpoints' keys), its padded shard's shape and
    its view of the flat reduce buffer; a buffer of another size is refused, naming the unused-parameter
    fix. The reduce-scatters refuse an op other than SUM before any collective (one rank, no launch)."""
    mesh = init_device_mesh("cpu", (1,))
    for frozen, fqns, shapes in ((None, ["weight", "bias"], [(3, 4), (3,)]), ("weight", ["bias"], [(3,)])):
        model = torch.nn.Linear(4, 3)
        if frozen:
            model.get_parameter(frozen).requires_grad_(False)
        fully_shard(model, mesh=mesh)
        model(torch.randn(2, 4))   # FSDP2's lazy init names the parameters
        slots = Slots(model)
        assert (slots.fqns, slots.shapes, slots.numel) == (fqns, shapes, sum(math.prod(s) for s in shapes))
        flat = torch.arange(float(slots.numel))
        views = slots.views(flat)
        assert [tuple(v.shape) for v in views] == shapes
        assert torch.equal(torch.cat([v.reshape(-1) for v in views]), flat)
        assert all(v.data_ptr() >= flat.data_ptr() for v in views)   # views, not copies
        with pytest.raises(RuntimeError, match=f"handed a reduce buffer of {slots.numel - 1} elements.*"
                                               "set_reduce_scatter_unused_params"):
            slots.views(flat[1:])
    for comm in (HomomorphicReduceScatter, RowExchangeReduceScatter, SelectionRowExchangeReduceScatter):
        with pytest.raises(ValueError, match="reduce-scatter sums; FSDP asked for"):
            comm(None, model)(flat, flat, None, op=dist.ReduceOp.AVG)


def test_slots_refuse_a_module_without_a_parameter_group(world_of_one):
    """Slots need exactly one FSDP parameter group: a ``fully_shard`` module that holds no parameter has none,
    refused with the ValueError that names the count (not an IndexError from the empty list)."""
    model = torch.nn.ReLU()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(ValueError, match="exactly one FSDP parameter group per fully_shard module, got 0"):
        Slots(model)


def _row_exchange(state_kind="auto", **options):
    """A Linear(64, 64) module sharded on a 1-D mesh of this one rank, its state (AutoFSDPState or, "topk",
    TopKFSDPState) and a reduce-scatter comm of the state's kind for it, driven directly."""
    from lossless_hc.plugins.fsdp import AutoFSDPState
    from lossless_hc.training.calibration import Calibration
    mesh = init_device_mesh("cpu", (1,))
    if state_kind == "topk":
        state, comm_class = TopKFSDPState(mesh, **options), SelectionRowExchangeReduceScatter
    else:
        state, comm_class = AutoFSDPState(mesh, calibration=Calibration.default(1e8), guard_steps=0, **options), \
            RowExchangeReduceScatter
    model = torch.nn.Linear(64, 64)
    fully_shard(model, mesh=mesh)
    model(torch.randn(2, 64))   # FSDP2's lazy init names the parameters
    return state, model, comm_class(state, model)


def _exchanged(state, comm, out, grad) -> bool:
    """One call of ``comm`` on this rank's ``grad`` (the sum over a group of one: ``grad`` itself, either way);
    whether it ran the exchange, which FSDP2's own reduce-scatter (the buffer, no counts) does not."""
    before = state._stats.payload_bytes
    comm(out, grad, dist.group.WORLD)
    assert torch.equal(out, grad)
    return state._stats.payload_bytes - before != grad.numel() * 4


def test_sparse_reduce_scatter_widens_its_check_of_a_dense_module(world_of_one):
    """AutoFSDPState's sparse reduce-scatter runs the exchange on a module whose every chunk goes whole only
    at its checks, whose interval widens as the planner's does for a tensor no calibration moves off dense:
    calls 0, 16, 32, 64, 128, 256, 512, 768 of 800 (``interval`` 16, ``max_interval`` 256), FSDP2's own
    reduce-scatter (which sends no counts) on the others; a check that finds rows returns it to 16, and from
    then on, the module being sparse, every call runs the exchange. ``max_interval=16`` keeps one check in
    16. The cadence, interval included, round-trips through state_dict (one rank, a Gloo group of one, the
    comm driven directly; the launched 1x2 and 2x2 meshes: tests/test_plugins_fsdp.py)."""
    for max_interval, want_checks in ((None, [0, 16, 32, 64, 128, 256, 512, 768]), (16, list(range(0, 800, 16)))):
        state, model, comm = _row_exchange(max_interval=max_interval)
        dense = torch.randn(64 * 64 + 64)
        out = torch.empty_like(dense)

        def exchanged(grad):
            return _exchanged(state, comm, out, grad)

        assert [c for c in range(800) if exchanged(dense)] == want_checks
        assert comm.interval == (256 if max_interval is None else 16) and comm.all_whole
        saved = comm.state_dict()
        assert saved == {"calls": 800, "all_whole": True, "interval": comm.interval}
        # the module turns sparse (one non-zero row of the weight, sent as rows): seen at the next check,
        # call 1024 (800 with max_interval 16), then back to 16 and the exchange on every call
        sparse = torch.zeros_like(dense)
        sparse[64:128] = 1.0
        caught = 1024 if max_interval is None else 800
        assert [c for c in range(800, 1100) if exchanged(sparse)] == list(range(caught, 1100))
        assert comm.interval == 16 and not comm.all_whole
        restored = RowExchangeReduceScatter(state, model)
        restored.load_state_dict(saved)
        assert restored.state_dict() == saved
        # a state saved before the interval was kept, or an interval this schedule cannot reach (saved under
        # another interval or a larger max_interval): the widening restarts from 16
        for interval in (None, 48, 512, 8, 64):
            restored.load_state_dict({"calls": 800, "all_whole": True, "interval": interval})
            assert restored.interval == (64 if interval == 64 and max_interval is None else 16), interval
        restored.load_state_dict({"calls": 0, "all_whole": False})   # saved before its first call
        assert restored.interval is None


@pytest.mark.parametrize("grad", ["zero", "sparse_weight_dense_bias"])
def test_a_module_any_chunk_of_which_goes_as_rows_keeps_the_exchange(world_of_one, grad):
    """The sparse reduce-scatter's check asks whether any chunk of the module went as rows, zero rows included:
    an all-zero gradient (every chunk sent as 0 rows, only the counts cross) and a module whose weight goes as
    rows while its dense bias goes whole are not all-dense, so every call runs the exchange and the check
    interval stays at the state's interval (16), never widened."""
    state, _, comm = _row_exchange()
    g = torch.zeros(64 * 64 + 64)
    if grad == "sparse_weight_dense_bias":
        g[64:128] = 1.0           # one row of the weight
        g[64 * 64:] = torch.randn(64)   # the whole bias
    out = torch.empty_like(g)
    assert all(_exchanged(state, comm, out, g) for _ in range(40))
    assert comm.interval == 16 and not comm.all_whole
    assert comm.state_dict() == {"calls": 40, "all_whole": False, "interval": 16}


def test_top_k_s_reduce_scatter_never_checks_and_restores_without_an_interval(world_of_one):
    """TopKFSDPState's reduce-scatter (SelectionRowExchangeReduceScatter) sends its selections on every call,
    chunks that go whole (ratio 0.5: k pairs would not be fewer bytes) included, since FSDP2's own would skip
    top-k: it never checks, so it keeps no check interval (None), counts its calls, and restores its cadence
    (calls > 0) without one, its state having no re-plan interval to restore from."""
    state, _, comm = _row_exchange("topk", ratio=0.5)
    g = torch.randn(64 * 64 + 64)
    out = torch.empty_like(g)
    for _ in range(3):
        before = state._stats.payload_bytes
        comm(out, g, dist.group.WORLD)
        assert state._stats.payload_bytes > before
    saved = comm.state_dict()
    assert saved == {"calls": 3, "all_whole": False, "interval": None}
    restored = SelectionRowExchangeReduceScatter(state, comm.module)
    restored.load_state_dict(saved)
    assert restored.state_dict() == saved
    restored.load_state_dict({"calls": 5, "all_whole": False, "interval": 32})   # no interval kept
    assert restored.state_dict() == {"calls": 5, "all_whole": False, "interval": None}
