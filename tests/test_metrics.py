"""shared/obs/metrics.py: LatencyHistogram (percentiles to within a bucket, merge, JSON form) and the
JSONL writer/reader (a torn last line from a killed writer is skipped)."""

from __future__ import annotations

import math
import random

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from millstream.shared.obs.metrics import LatencyHistogram, MetricsWriter, NullMetrics, read_jsonl

#: One bucket's width: 16 log-spaced buckets per doubling.
BUCKET = 2 ** (1 / 16)
QS = (0, 1, 10, 25, 29, 50, 75, 90, 95, 99, 99.9, 100)

# Durations inside the histogram's range [low_s, low_s * 2**24) = [1e-4 s, ~1678 s).
durations = st.floats(min_value=1e-4, max_value=1000.0, allow_nan=False, allow_infinity=False)


def _hist(samples, **kw) -> LatencyHistogram:
    hist = LatencyHistogram(**kw)
    for s in samples:
        hist.add(s)
    return hist


def _within_a_bucket(value: float, reference: float) -> bool:
    return reference / BUCKET <= value <= reference * BUCKET


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(durations, min_size=1, max_size=300))
def test_percentiles_within_a_bucket_of_numpy(samples):
    hist = _hist(samples)
    assert hist.total == len(samples)
    assert hist.mean() == pytest.approx(float(np.mean(samples)), rel=1e-9)
    previous = 0.0
    for q in QS:
        # The histogram reports the nearest-rank percentile (numpy's "inverted_cdf").
        reference = float(np.percentile(samples, q, method="inverted_cdf"))
        value = hist.percentile(q)
        assert _within_a_bucket(value, reference), (q, value, reference)
        assert value >= previous  # monotone in q
        previous = value


def test_percentiles_of_a_large_seeded_sample():
    rng = np.random.default_rng(1234)
    samples = rng.lognormal(mean=math.log(0.05), sigma=1.0, size=20_000)  # ~50 ms, long tail
    hist = _hist(samples.tolist())
    for q in (50, 95, 99, 99.9):
        reference = float(np.percentile(samples, q))  # numpy's default (linear) method
        value = hist.percentile(q)
        assert abs(value / reference - 1) < BUCKET - 1, (q, value, reference)
    # A point mass: every percentile is that bucket's middle, 1/32 doubling from the value.
    point = _hist([0.25] * 1000)
    assert {point.percentile(q) for q in QS} == {point.percentile(50)}
    assert point.percentile(50) / 0.25 == pytest.approx(1, abs=2 ** (1 / 32) - 1 + 1e-12)


def test_out_of_range_durations_are_clamped_not_lost():
    hist = _hist([0.0, 1e-7, 5e-5])
    assert hist.counts[0] == 3 and hist.total == 3
    assert hist.percentile(100) == pytest.approx(1e-4 * 2 ** (0.5 / 16))
    hist.add(1e6)  # far past the last bucket (~1678 s)
    assert hist.counts[-1] == 1 and hist.total == 4
    assert hist.percentile(100) == pytest.approx(1e-4 * 2 ** ((len(hist.counts) - 0.5) / 16))
    assert hist.mean() == pytest.approx((1e-7 + 5e-5 + 1e6) / 4)  # the mean stays exact


@settings(max_examples=100, deadline=None, database=None)
@given(st.lists(st.lists(durations, max_size=60), min_size=1, max_size=5))
def test_merge_equals_adding_every_sample_to_one(parts):
    merged = LatencyHistogram()
    for part in parts:
        merged.merge(_hist(part))
    everything = [s for part in parts for s in part]
    one = _hist(everything)
    assert merged.counts == one.counts
    assert merged.total == one.total == len(everything)
    assert merged.sum_s == pytest.approx(one.sum_s, rel=1e-9, abs=1e-12)
    assert [merged.percentile(q) for q in QS] == [one.percentile(q) for q in QS]


def test_merge_leaves_the_other_unchanged_and_empty_is_neutral():
    a, b = _hist([0.01, 0.02]), _hist([0.5])
    b_counts = list(b.counts)
    a.merge(b)
    a.merge(LatencyHistogram())
    assert a.total == 3 and a.sum_s == pytest.approx(0.53)
    assert b.counts == b_counts and b.total == 1


@settings(max_examples=100, deadline=None, database=None)
@given(st.lists(durations, max_size=200), st.sampled_from([(1e-4, 24), (1e-3, 20), (1e-6, 30)]))
def test_to_dict_from_dict_roundtrip_through_json(samples, shape):
    low_s, doublings = shape
    hist = _hist(samples, low_s=low_s, doublings=doublings)
    data = orjson.loads(orjson.dumps(hist.to_dict()))
    assert data["low_s"] == low_s and data["n"] == doublings * 16
    assert all(c > 0 for c in data["buckets"].values())  # sparse: empty buckets are left out
    back = LatencyHistogram.from_dict(data)
    assert (back.low_s, back.counts, back.total, back.sum_s) == (
        hist.low_s,
        hist.counts,
        hist.total,
        hist.sum_s,
    )
    assert [back.percentile(q) for q in QS] == [hist.percentile(q) for q in QS]
    back.merge(hist)  # same buckets: mergeable
    assert back.total == 2 * len(samples)


def test_empty_histogram():
    hist = LatencyHistogram()
    assert hist.total == 0
    assert hist.percentile(50) is None and hist.percentile(0) is None and hist.percentile(100) is None
    assert hist.mean() is None
    data = hist.to_dict()
    assert data["buckets"] == {} and data["sum_s"] == 0.0
    back = LatencyHistogram.from_dict(data)
    assert back.total == 0 and back.percentile(99) is None


@pytest.mark.parametrize(
    "other",
    [
        LatencyHistogram(low_s=1e-3),
        LatencyHistogram(doublings=20),
        LatencyHistogram(low_s=1e-3, doublings=20),
    ],
)
def test_mismatched_buckets_raise(other):
    hist = _hist([0.1])
    other.add(0.1)
    with pytest.raises(ValueError, match="different buckets"):
        hist.merge(other)
    with pytest.raises(ValueError, match="different buckets"):
        other.merge(hist)
    assert hist.total == 1 and other.total == 1  # nothing half-merged


# --- JSONL ------------------------------------------------------------------------------------


def test_writer_and_reader_roundtrip_with_numpy_and_time(tmp_path):
    path = tmp_path / "sub" / "m.jsonl"  # the folder is created
    writer = MetricsWriter(path)
    writer.write({"step": 1, "reward/mean": np.float32(0.5), "n": np.int64(3)})
    writer.write({"step": 2, "arr": np.arange(3)})
    writer.close()
    records = read_jsonl(path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["reward/mean"] == 0.5 and records[0]["n"] == 3 and records[1]["arr"] == [0, 1, 2]
    assert all(isinstance(r["time"], float) and r["time"] > 1.6e9 for r in records)
    # Reopening appends.
    writer = MetricsWriter(path)
    writer.write({"step": 3})
    writer.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    NullMetrics().write({"step": 4})  # does nothing, and never fails
    assert len(read_jsonl(path)) == 3


@pytest.mark.parametrize("cut", [1, 7, -2, -1])
def test_reader_skips_a_torn_last_line(tmp_path, cut):
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(path)
    for step in range(3):
        writer.write({"step": step, "loss": 0.1 * step})
    writer.close()
    whole = orjson.dumps({"time": 1.0, "step": 3, "loss": 0.3})
    with path.open("ab") as f:
        f.write(whole[:cut])  # a writer killed mid-record: no closing brace, no newline
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2]


def test_reader_of_an_empty_or_only_torn_file(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"")
    assert read_jsonl(path) == []
    path.write_bytes(b'{"time": 1.0, "st')
    assert read_jsonl(path) == []


def test_writer_reopened_after_a_torn_line_keeps_its_records(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(orjson.dumps({"time": 1.0, "step": 0}) + b"\n" + b'{"time": 2.0, "st')
    writer = MetricsWriter(path)  # e.g. a resumed learner writing into the same run folder
    writer.write({"step": 1})
    writer.close()
    assert [r["step"] for r in read_jsonl(path)] == [0, 1]


def test_percentile_rank_is_nearest_rank():
    # 100 distinct well-separated values: percentile q is the ceil(q)-th smallest (rank >= 1).
    values = [0.001 * 1.1**i for i in range(100)]  # 1 ms .. 12.5 s, 10% apart
    shuffled = values[:]
    random.Random(0).shuffle(shuffled)
    hist = _hist(shuffled)
    for q, rank in ((0, 1), (1, 1), (1.5, 2), (50, 50), (99, 99), (99.5, 100), (100, 100)):
        assert _within_a_bucket(hist.percentile(q), values[rank - 1]), q
        if rank < 100:
            assert not _within_a_bucket(hist.percentile(q), values[rank]), q
