"""The counters an aggregator keeps (lossless_hc.training.aggregate.AggregationStats), in one process: what
each encode, decode, fallback and partial re-aggregation adds, against the sizes the aggregator was built
for."""
import torch

from lossless_hc.training.aggregate import AggregationStats, TensorAggregator


def test_empty_stats_count_nothing_and_report_a_wire_ratio_of_one():
    """Nothing sent yet: every counter is zero, no failure is named, and the ratio is 1.0 (no division
    by zero dense bytes)."""
    st = AggregationStats()
    d = st.as_dict()
    assert d.pop("last_failure") is None and d.pop("wire_ratio") == 1.0
    assert set(d.values()) == {0}, d


def test_each_encode_counts_one_tensor_its_dense_bytes_and_what_it_sent():
    """A compressed tensor sends its codec's payload, a dense one (float64: no codec) itself; both count
    the bytes the uncompressed allreduce would send, and wire_ratio is their quotient, exactly."""
    st = AggregationStats()
    comp = TensorAggregator("c", (1000, 16), torch.float32, 2, 0.05, stats=st)
    dense = TensorAggregator("d", (100,), torch.float64, 2, 0.05, stats=st)
    assert comp.compressed and not dense.compressed
    x = torch.zeros(1000, 16)
    x[3] = 1.0
    payload, _ = comp.encode(x)
    wire = payload.numel() * payload.element_size()
    assert (st.tensors, st.compressed, st.sent_dense) == (1, 1, 0)
    assert (st.payload_bytes, st.dense_bytes) == (wire, 1000 * 16 * 4)
    dense.encode(torch.ones(100, dtype=torch.float64))
    dense.encode(torch.ones(100, dtype=torch.float64))
    assert (st.tensors, st.compressed, st.sent_dense) == (3, 1, 2)
    assert (st.payload_bytes, st.dense_bytes) == (wire + 2 * 800, 1000 * 16 * 4 + 2 * 800)
    assert st.wire_ratio == (wire + 1600) / (64000 + 1600) < 1.0
    assert st.as_dict()["wire_ratio"] == st.wire_ratio
