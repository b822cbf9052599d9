"""FSDP2's parameter slots and the reduce-scatters (``set_custom_reduce_scatter``) of
:mod:`lossless_hc.plugins.fsdp`, which owns the states, the mesh and the replica all-reduce: the
homomorphic one of ``LosslessFSDPState`` (:class:`HomomorphicReduceScatter`, below), and the row
exchanges (:mod:`lossless_hc.training.row_exchange`): the planner's exact sparse one
(:class:`RowExchangeReduceScatter`, rows sent to their owner as they are) and top-k's
(:class:`SelectionRowExchangeReduceScatter`, each rank's selection sent so).

The homomorphic reduce-scatter, per ``fully_shard`` module and step (S ranks in the shard group, rank
``me``):

1. every rank encodes each destination ``d``'s chunk separately (one aggregator per parameter and
   destination), and one all-to-all per part dtype hands ``d`` every rank's message for ``d``, which
   ``d`` sums (:func:`all_to_all_sum`); the payloads are homomorphic, so that is a payload of the
   summed chunk, and ``d`` decodes it;
2. the owners share a table (one int64 SUM all-reduce): per destination and parameter whether its
   decode failed (with the record :func:`~lossless_hc.training.message.replay_failure` needs, so that
   every rank grows the same capacities), or reported inexact keys (and how many of their coordinates
   its bounds leave unproven, :func:`~lossless_hc.lhc.contract.unproven_coordinates`);
3. only where some owner reported inexact keys: those coordinates, one all-gather of each owner's
   concatenated coordinates (padded to the longest), so that every rank can read its values there;
4. only where some decode failed or was inexact: one :func:`all_to_all_sum` of float32 rows,
   destination ``d``'s row holding every failed parameter's whole chunk, then ``d``'s inexact
   coordinates' values. Each owner finishes its fallbacks and its partial re-aggregations
   (:meth:`~lossless_hc.training.aggregate.TensorAggregator.finish_partial`) from its row.

Destinations' messages differ in length (each destination's capacities grow with its own chunk's
support: under skewed ids the shard holding the hot rows grows alone). A reduce-scatter would pad
every destination's part to the longest, so the exchange is an all-to-all of rows as they are, whose
bytes are those of a reduce-scatter of equal rows and otherwise fewer.

So an inexact decode costs the values at its keys' unproven coordinates, as in the replica all-reduce, not
the whole chunk; it falls back densely (and grows the capacity) only past the aggregator's
``partial_max_fraction``, as everywhere else. Every collective is issued by every rank of the group
or by none: each decision is read from the table, which every rank holds whole.
"""
from __future__ import annotations

import math
import time
from typing import List, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from lossless_hc.training.aggregate import ConfigurationMismatch, partial_values
from lossless_hc.training.message import (PART_DTYPES, decode_segments, dense_values, encode_message, failure_record,
                                          finish_fallbacks, replay_failure)
from lossless_hc.training.plan_tracker import restored_interval, widened_interval
from lossless_hc.training.row_exchange import (NARROWED, WHOLE, GivenRows, add_segments, encode_destinations,
                                               received_nbytes, rows_are_smaller, whole_dtype)

try:   # the ReduceScatter interface of set_custom_reduce_scatter (torch >= 2.8)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as ReduceScatterBase
except ImportError:  # pragma: no cover - older torch: register(reduce_scatter=True) says so
    ReduceScatterBase = object

# the owners' table: per destination and parameter, the outcome ...
_OK, _FAILED, _MISMATCH, _PARTIAL = 0, 1, 2, 3
# ... and its columns: outcome, failure record (status, total keys, overloaded ranks), inexact coordinates
_TABLE_COLUMNS = 5


def all_to_all_sum(rows: List[torch.Tensor], group) -> torch.Tensor:
    """A SUM reduce-scatter of rows of different lengths: ``rows[d]`` (1-D, one dtype on every rank) goes
    to rank ``d`` of the ``len(rows)``-rank ``group``, and this rank gets the element-wise sum of every
    rank's row for it, summed in the row's dtype (torch's sum over the ranks' rows). Every rank must
    hand rows of the same lengths (each derives every destination's length alike). One all-to-all,
    blocking."""
    n, me = len(rows), dist.get_rank(group)
    length = rows[me].numel()
    received = torch.empty(n * length, dtype=rows[me].dtype, device=rows[me].device)
    dist.all_to_all_single(received, torch.cat(rows), output_split_sizes=[length] * n,
                           input_split_sizes=[r.numel() for r in rows], group=group)
    return received.view(n, length).sum(0, dtype=received.dtype)


def native_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op, group) -> None:
    """FSDP2's own reduce-scatter of the buffer as it is (its ``DefaultReduceScatter``, blocking):
    ``dist.reduce_scatter_single`` where torch has it (2.13), ``dist.reduce_scatter_tensor`` before."""
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    collective(output, input, op=op, group=group)


def all_gather_stacked(t: torch.Tensor, group, n: int) -> torch.Tensor:
    """Every rank's ``t`` of the ``n``-rank ``group``, stacked in rank order (blocking)."""
    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t, group=group)
    return torch.stack(out)


def param_groups(module: FSDPModule) -> list:
    """The FSDP parameter groups of a ``fully_shard`` module: a list on torch 2.13 (``_fsdp_param_groups``),
    one group or None on earlier releases such as 2.11 (``_fsdp_param_group``)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


class Slots:
    """Where each parameter lies in an FSDP2 parameter group's flat reduce-scatter output: in
    ``fsdp_params`` order, a slot of ``padded_sharded_param_size`` (zero padding included, so a slot
    has the same shape on every rank and for every destination), for the parameters that require grad
    when the slots are made (the module's first reduction): FSDP2 reduces the gradients a step produced,
    and a frozen parameter produces none."""

    def __init__(self, module: FSDPModule):
        groups = param_groups(module)
        if len(groups) != 1:
            raise ValueError(f"{type(module).__name__}: lossless_hc.plugins.fsdp needs exactly one FSDP parameter "
                             f"group per fully_shard module, got {len(groups)}")
        self.fqns, self.shapes = [], []
        for i, fp in enumerate(groups[0].fsdp_params):
            if not fp.sharded_param.requires_grad:
                continue
            fqn = getattr(fp, "_param_fqn", None) or f"{type(module).__name__}.param{i}"
            self.fqns.append(fqn)
            self.shapes.append(tuple(fp.padded_sharded_param_size))
        self.numel = sum(math.prod(s) for s in self.shapes)

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        if flat.numel() != self.numel:
            raise RuntimeError(f"FSDP2 handed a reduce buffer of {flat.numel()} elements; the padded shards of the "
                               f"parameters that required grad at the first step, {dict(zip(self.fqns, self.shapes))}, "
                               f"hold {self.numel}. A parameter got no gradient in this step (unused in the forward), "
                               "or requires_grad changed since: lossless_hc needs the same parameters to get a "
                               "gradient every step (freeze the others with requires_grad_(False) before the first "
                               "step, or call set_reduce_scatter_unused_params(True) on the fully_shard module, "
                               "which reduces a zero gradient for an unused one); or a Shard(i>0) placement with "
                               "uneven shards, which it does not support")
        out, offset = [], 0
        for shape in self.shapes:
            m = math.prod(shape)
            out.append(flat[offset:offset + m].view(shape))
            offset += m
        return out


class _SumReduceScatter(ReduceScatterBase):
    """What the reduce-scatters share: their state and ``fully_shard`` module, FSDP2's buffer allocation,
    and the SUM they implement (``kind`` names them in the error)."""

    kind = ""

    def __init__(self, state, module: FSDPModule):
        self.state, self.module, self.slots = state, module, None

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _check_sum(self, op) -> None:
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"the {self.kind} reduce-scatter sums; FSDP asked for {op} (register() sets sum-only "
                             "reductions: do not undo set_force_sum_reduction_for_comms)")


class HomomorphicReduceScatter(_SumReduceScatter):
    """``FSDPModule.set_custom_reduce_scatter`` comm of one ``fully_shard`` module: a SUM reduce-scatter
    of encoded chunks (see the module doc). ``state``: the :mod:`~lossless_hc.plugins.fsdp` state
    (its ``_aggregator`` and ``_device``). Synchronous: returns None."""

    kind = "homomorphic"

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False):
        self._check_sum(op)
        st = self.state
        if self.slots is None:
            self.slots = Slots(self.module)
        n, me = dist.get_world_size(group), dist.get_rank(group)
        chunks = input_tensor.view(n, -1)
        messages = []
        for d in range(n):
            views = self.slots.views(chunks[d])
            aggs = [st._aggregator(f"shard:{fqn}->{d}", v, n, me) for fqn, v in zip(self.slots.fqns, views)]
            messages.append(encode_message(aggs, views))
        summed = self._reduce_scatter_parts(messages, input_tensor.device, group)

        own = messages[me]
        outcomes, reason = None, None
        try:
            outcomes = decode_segments(own, [summed[p.dtype][:p.numel()] for p in own.parts])
        except ConfigurationMismatch as e:   # raised below on every rank, after the table
            reason = str(e)
        table = self._share_outcomes(outcomes, me, n, group)
        if bool((table[:, :, 0] == _MISMATCH).any()):
            bad = sorted({int(r) for r in (table[:, :, 0] == _MISMATCH).nonzero()[:, 0]})
            raise ConfigurationMismatch(reason or f"ranks {bad} of the shard group could not decode their "
                                                  "reduce-scatter payloads: ranks are configured differently")
        for d in range(n):
            for i in range(len(self.slots.fqns)):
                if d != me and int(table[d, i, 0]) == _FAILED:
                    replay_failure(messages[d].aggregators[i], *table[d, i, 1:4].tolist())
        results = [o.value for o in outcomes]
        if bool((table[:, :, 0] != _OK).any()):   # failed or inexact decodes (a mismatch raised above)
            self._re_aggregate(messages, outcomes, results, table, me, group)
        for view, value in zip(self.slots.views(output_tensor), results):
            view.copy_(value.reshape(view.shape))
        return None

    def _reduce_scatter_parts(self, messages, device: torch.device, group) -> dict:
        """One :func:`all_to_all_sum` per part dtype, widest first: destination d's part of that dtype
        (none: an empty one). Every rank derives every destination's parts alike. Returns this rank's
        sums by dtype."""
        dtypes = [dt for dt in PART_DTYPES if any(p.dtype == dt for m in messages for p in m.parts)]
        summed = {}
        for dt in dtypes:
            rows = [next((p for p in m.parts if p.dtype == dt), None) for m in messages]
            rows = [torch.empty(0, dtype=dt, device=device) if p is None else p.reshape(-1) for p in rows]
            summed[dt] = all_to_all_sum(rows, group)
        return summed

    def _share_outcomes(self, outcomes, me: int, n: int, group) -> torch.Tensor:
        """The owners' table (module doc, step 2), summed over the group: ``[d, i]`` is destination d's
        outcome for parameter i, its failure record, and the count of its inexact keys' coordinates to
        re-aggregate (``outcome.partial``)."""
        params = len(self.slots.fqns)
        table = torch.zeros(n, params, _TABLE_COLUMNS, dtype=torch.int64, device=self.state._device())
        for i in range(params):
            if outcomes is None:
                table[me, i, 0] = _MISMATCH
            elif outcomes[i].needs_fallback:
                table[me, i, 0] = _FAILED
                table[me, i, 1:4] = torch.tensor(failure_record(outcomes[i]))
            elif outcomes[i].needs_partial:
                table[me, i, 0] = _PARTIAL
                table[me, i, 4] = outcomes[i].partial.numel()
        dist.all_reduce(table, group=group)
        return table

    def _inexact_coordinates(self, messages, outcomes, table: torch.Tensor, me: int, group) -> dict:
        """``{(d, i): flat coordinates}`` to re-aggregate for every destination's inexact keys (module doc,
        step 3): the owners' ``outcome.partial`` (the keys' coordinates their bounds do not prove, which
        only the owner, who decoded, can tell), all-gathered."""
        counts = table[:, :, 4].tolist()
        width = max(sum(row) for row in counts)
        if width == 0:
            return {}
        device = self.state._device()
        mine = torch.zeros(width, dtype=torch.int64, device=device)
        offset = 0
        for i, o in enumerate(outcomes):
            if counts[me][i]:
                mine[offset:offset + counts[me][i]] = o.partial.to(device=device, dtype=torch.int64)
                offset += counts[me][i]
        gathered = all_gather_stacked(mine, group, len(messages))
        # the coordinates' bytes: this rank's row, counted with its first tensor
        messages[me].aggregators[0].stats.payload_bytes += width * 8
        coords = {}
        for d, row in enumerate(counts):
            offset = 0
            for i, c in enumerate(row):
                if not c:
                    continue
                if d == me:
                    coords[d, i] = outcomes[i].partial
                else:
                    coords[d, i] = gathered[d, offset:offset + c].to(messages[d].aggregators[i].device)
                offset += c
        return coords

    def _re_aggregate(self, messages, outcomes, results: list, table: torch.Tensor, me: int, group) -> None:
        """Module doc, steps 3 and 4: every destination's failed parameters' chunks and inexact
        coordinates' values, reduce-scattered exactly as float32 rows; this rank's ``results`` finished
        from its own row."""
        params = len(self.slots.fqns)
        failed = [i for i in range(params) if bool((table[:, i, 0] == _FAILED).any())]
        coords = self._inexact_coordinates(messages, outcomes, table, me, group)
        rows = []
        for d, m in enumerate(messages):
            values = [partial_values(m.encoded[i][1], c).to(torch.float32)
                      for (dd, i), c in sorted(coords.items()) if dd == d]
            rows.append(torch.cat([dense_values(m, failed)] + values))
        out = all_to_all_sum(rows, group)
        own = messages[me]
        # sent: every destination's row; counted so far: this rank's own fallbacks' and inexact values'
        # bytes in their dtypes (the decodes counted them)
        counted = sum(math.prod(own.encoded[i][1].shape) * own.encoded[i][1].dtype.itemsize
                      for i in failed if outcomes[i].needs_fallback)
        counted += sum(c.numel() * own.encoded[i][1].dtype.itemsize for (d, i), c in coords.items() if d == me)
        own.aggregators[0].stats.payload_bytes += sum(r.numel() for r in rows) * 4 - counted
        numels = [math.prod(own.encoded[i][1].shape) for i in failed]
        pieces = dict(zip(failed, out[:sum(numels)].split(numels)))
        mine = [i for i in failed if outcomes[i].needs_fallback]   # the others decoded here: kept
        if mine:
            part = torch.cat([pieces[i] for i in mine])
            for i, value in zip(mine, finish_fallbacks(own, outcomes, mine, part)):
                results[i] = value
        offset = sum(numels)
        for (d, i), c in sorted(coords.items()):
            if d == me:
                results[i] = own.aggregators[i].finish_partial(out[offset:offset + c.numel()], outcomes[i])
                offset += c.numel()


class RowExchangeReduceScatter(_SumReduceScatter):
    """``FSDPModule.set_custom_reduce_scatter`` comm of one ``fully_shard`` module for the planner
    (:class:`~lossless_hc.plugins.fsdp.AutoFSDPState`): the exact sparse reduce-scatter of
    :mod:`lossless_hc.training.row_exchange`. Each rank sends each destination every parameter's chunk
    as its non-zero rows or as it is (whichever is fewer bytes, decided by the sender), announced by
    one all-to-all of counts (one int64 per destination and parameter) and carried by one all-to-all of
    bytes; the owner adds them up. No statistics cross ranks and nothing can fail to decode, so there
    is nothing to agree on afterwards. The state's ``_narrow_dtype(parameter bytes)`` says in which dtype
    a parameter's chunks sent whole cross (None: as they are), and its ``_phase`` whether this call runs
    the exchange or, in the step guard's dense window and after a dense verdict, FSDP2's own
    reduce-scatter in those dtypes (:meth:`_native`).

    A module whose chunks are all dense (a linear layer's) gains nothing from the exchange and pays its
    extra round (the counts) and its owner's sums. So the exchange runs on the module's calls whose
    count (from 0) is a multiple of ``interval``, its current check interval, and the group learns, by
    one int64 MAX all-reduce, whether any rank sent rows of it; where none did, the module's calls until
    the next check go to FSDP2's own reduce-scatter (:meth:`_native`: the same bytes and sum, exact). The
    check interval starts at the state's re-plan ``interval`` and widens as the planner's does for a
    tensor no calibration moves off dense (:meth:`PlanTracker.reschedule
    <lossless_hc.training.plan_tracker.PlanTracker.reschedule>`): each check from call ``interval`` on
    that finds every chunk whole doubles it, up to the state's ``max_interval``, and a check that finds
    rows returns it to ``interval``. With ``interval`` 16 and ``max_interval`` 256 an all-dense module
    runs the exchange on calls 0, 16, 32, 64, 128, 256, 512, 768, ... instead of one in 16; a module
    that turns sparse is caught at the next check, up to ``max_interval`` calls later.
    Synchronous: returns None."""

    kind = "sparse"
    checks_dense_modules = True   # a module whose every chunk went whole goes to FSDP2's own (below)

    def __init__(self, state, module: FSDPModule):
        super().__init__(state, module)
        self.narrow = self.wire = None
        self.calls = 0             # this module's reduce-scatters so far (alike on every rank)
        self.all_whole = False     # at the last check, every rank sent every chunk of this module whole
        self.interval = None       # the current check interval (None: the state's interval, at the first call)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False):
        self._check_sum(op)
        n = dist.get_world_size(group)
        if self.slots is None:
            self.slots = Slots(self.module)
            # a parameter's bytes: its n padded shards'
            self.narrow = [self.state._narrow_dtype(n * math.prod(s) * input_tensor.element_size())
                           for s in self.slots.shapes]
            self.wire = [whole_dtype(input_tensor.dtype, nd) for nd in self.narrow]   # each sent whole in
        started = time.perf_counter()
        call, check = self.calls, False
        if self.checks_dense_modules:
            interval, max_interval = self.state._row_check_intervals()
            if self.interval is None:
                self.interval = interval
            check = call % self.interval == 0
        self.calls += 1
        if self.state._phase(self, started) == "dense" or (self.all_whole and not check):
            self._native(output_tensor, input_tensor, op, group, n)
            return None
        chunks = input_tensor.view(n, -1)
        me = dist.get_rank(group)
        segments = [self._sent(self.slots.views(chunks[d]), d, n, me) for d in range(n)]
        counts, payload, sizes = encode_destinations(segments, self.narrow, source=self._source(input_tensor))
        self.state._stats.encode_seconds += time.perf_counter() - started
        sent = torch.tensor(counts, dtype=torch.int64).reshape(n, -1).to(input_tensor.device)
        announced = torch.empty_like(sent)
        dist.all_to_all_single(announced, sent, group=group)
        mine = self._received(self.slots.views(output_tensor))
        lengths = [received_nbytes(row, mine, self.narrow) for row in announced.tolist()]
        received = torch.empty(sum(lengths), dtype=torch.uint8, device=input_tensor.device)
        dist.all_to_all_single(received, payload, output_split_sizes=lengths, input_split_sizes=sizes, group=group)
        summing = time.perf_counter()
        add_segments(mine, announced, received, self.narrow)
        self.state._stats.decode_seconds += time.perf_counter() - summing
        self._count(counts, sizes, input_tensor.element_size())
        if check:   # one int64 MAX over the group: did any rank send rows of this module's chunks?
            rows = torch.tensor([int(any(c >= 0 for row in counts for c in row))], device=input_tensor.device)
            dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=group)
            self.all_whole = not bool(rows.item())
            # the class doc's widening (the planner's rule: not on the first check, call 0)
            self.interval = widened_interval(self.interval, interval, max_interval, call) if self.all_whole \
                else interval
        return None

    def state_dict(self) -> dict:
        """The check cadence (``calls``, ``all_whole``, ``interval``: None before the first call): a resumed
        run takes the same collectives at the same steps as the run it continues, hence the same sums, bit
        for bit."""
        return {"calls": self.calls, "all_whole": self.all_whole, "interval": self.interval}

    @staticmethod
    def check_state(state) -> None:
        """``ValueError`` unless ``state`` is a :meth:`state_dict` (``calls`` an int >= 0, ``all_whole`` a bool,
        ``interval`` None, absent (a state saved before it was kept) or an int >= 1)."""
        calls, whole = (state.get("calls"), state.get("all_whole")) if isinstance(state, dict) else (None, None)
        interval = state.get("interval") if isinstance(state, dict) else None
        if (isinstance(calls, bool) or not isinstance(calls, int) or calls < 0 or not isinstance(whole, bool)
                or (interval is not None and (isinstance(interval, bool) or not isinstance(interval, int)
                                              or interval < 1))):
            raise ValueError(f"not a sparse reduce-scatter's state (calls, all_whole, interval): {state!r}")

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (checked by :meth:`check_state`). A saved ``interval`` this state's
        schedule cannot reach (not its ``interval`` times a power of two up to its ``max_interval``: saved
        under other options) or none restarts the widening from ``interval``, as a restored
        :class:`~lossless_hc.training.plan_tracker.PlanTracker` does."""
        self.check_state(state)
        self.calls, self.all_whole, self.interval = state["calls"], state["all_whole"], None
        if self.checks_dense_modules and self.calls > 0:
            self.interval = restored_interval(state.get("interval"), *self.state._row_check_intervals())

    def _native(self, output: torch.Tensor, input: torch.Tensor, op, group, n: int) -> None:
        """FSDP2's own reduce-scatter (the step guard's dense window and dense verdict), each parameter in
        the dtype the exchange sends its chunks whole in: the buffer as it is where nothing is narrowed,
        else one reduce-scatter per dtype of the parameters' slots gathered from every destination's
        chunk (what ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`` sends for the narrowed ones,
        summed in that dtype as FSDP2's own is), written back into their slots of ``output``."""
        sizes, wire = [math.prod(s) for s in self.slots.shapes], self.wire
        if all(dt == input.dtype for dt in wire):
            native_reduce_scatter(output, input, op, group)
        else:
            chunks, outs = input.view(n, -1), [v.view(-1) for v in self.slots.views(output)]
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            for dt in dict.fromkeys(wire):   # in slot order of first appearance, alike on every rank
                mine = [i for i, w in enumerate(wire) if w == dt]
                sent = torch.cat([chunks[:, starts[i]:starts[i] + sizes[i]] for i in mine], dim=1).to(dt)
                got = torch.empty(sent.shape[1], dtype=dt, device=input.device)
                native_reduce_scatter(got, sent.reshape(-1), op, group)
                for i, piece in zip(mine, got.split([sizes[i] for i in mine])):
                    outs[i].copy_(piece)
        whole = [WHOLE if dt == input.dtype else NARROWED for dt in wire]   # as the exchange counts them
        self._count([whole] * n, [sum(m * dt.itemsize for m, dt in zip(sizes, wire))] * n, input.element_size(),
                    count_bytes=0)

    def _sent(self, views: List[torch.Tensor], d: int, n: int, me: int) -> List[torch.Tensor]:
        """What this rank sends destination ``d`` for its parameters' chunks ``views``: the chunks."""
        return views

    def _received(self, views: List[torch.Tensor]) -> List[torch.Tensor]:
        """This rank's chunks as the senders' segments address them (shaped as :meth:`_sent`'s)."""
        return views

    def _source(self, input_tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """The buffer whose bytes are :meth:`_sent`'s chunks in order (sent as it is where every chunk goes
        whole): the reduce-scatter's input, whose slots they are."""
        return input_tensor

    def _count(self, counts, sizes, itemsize: int, count_bytes: int = 8) -> None:
        """This rank's part in the state's stats: per destination and parameter, the chunk's bytes as
        dense (its slot's, ``itemsize`` each) and its segment (``compressed``: sent as rows or narrowed),
        plus the counts' bytes, ``count_bytes`` each (0: FSDP2's own reduce-scatter, which sends none;
        the times: the segments' encoding and the owner's sum, apart from the collectives)."""
        st = self.state._stats
        for row, nbytes in zip(counts, sizes):
            for c, shape in zip(row, self.slots.shapes):
                st.tensors += 1
                st.dense_bytes += math.prod(shape) * itemsize
                st.compressed += c != WHOLE
                st.sent_dense += c == WHOLE
            st.payload_bytes += nbytes + count_bytes * len(row)


class SelectionRowExchangeReduceScatter(RowExchangeReduceScatter):
    """The reduce-scatter of :class:`~lossless_hc.plugins.fsdp.TopKFSDPState`: each rank's top-k selection
    of every chunk (its :class:`~lossless_hc.training.topk_aggregate.TopKAggregator` per parameter and
    destination, error feedback included; built without the LHC codec, which it does not use) sent to the
    owner as rows of one element -- an int64 index and a value per selected coordinate, fewer bytes than a
    homomorphic payload sized for the union of every rank's selections -- and summed there exactly. A
    chunk whose k pairs would not be fewer bytes than the chunk itself (8 + s bytes a pair against s an
    element, s its element size, both padded to 8 bytes as sent: k above about a third of a float32 chunk;
    :func:`~lossless_hc.training.row_exchange.rows_are_smaller`, the exchange's one rule) goes whole, with what its
    residual held, as a dense reduce-scatter sends it. A residual that
    a non-finite gradient (an AMP scaler's overflow step) made non-finite is dropped on the rank that
    holds it, so that later steps stay finite (the other ranks, which never see it, keep theirs)."""

    checks_dense_modules = False   # the selections are not the buffer: FSDP2's own would skip top-k

    def _sent(self, views, d, n, me):
        out = []
        for fqn, v in zip(self.slots.fqns, views):
            agg = self.state._aggregator(f"shard:{fqn}->{d}", v, n, me, sketch=False)
            if rows_are_smaller(agg.k, v.numel(), 1, v.dtype, v.dtype):   # the selection as it comes, no dense tensor built and scanned again
                index, values = agg.select_pairs(v)   # in v's dtype, its rounding kept in the residual
                values = values.to(v.dtype)
                sent = values != 0   # k may exceed the non-zeros (a sparse gradient): zeros add nothing
                out.append(GivenRows(index[sent], values[sent], v.numel()))
            else:   # the tensor with what its residual held
                out.append(agg.select(v).reshape(-1))
            if agg.residual is not None and not bool(torch.isfinite(agg.residual).all()):
                agg.residual = None
        return out

    def _received(self, views):
        return [v.view(-1) for v in views]

    def _source(self, input_tensor):
        return None   # the selections, with their residuals, are not the buffer's bytes
