"""Metrics on hand-made events and records (values computed by hand in the comments)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl_fair.cost import PrefixAwareTokens, ProfiledQuadratic, WeightedTokens, event_service
from sgl_fair.metrics import (
    EventArrays,
    accumulated_service,
    accumulated_service_diff,
    active_interval,
    cache_hit_rate,
    jain_index,
    jain_over_active_interval,
    per_client_latency,
    per_client_service,
    percentiles,
    program_latency,
    service_difference,
    service_difference_windows,
    service_rate_series,
    summarize,
    throughput,
)
from sgl_fair.records import EventKind, RequestRecord, ServiceEvent


def prefill(t: float, client: str, input_len: int, *, extend_len: int | None = None, rid="r"):
    extend = input_len if extend_len is None else extend_len
    return ServiceEvent(t, client, rid, EventKind.PREFILL, input_len, extend_len=extend)


def decode(t: float, client: str, num: int, *, start: int = 0, input_len: int = 10, rid="r"):
    return ServiceEvent(t, client, rid, EventKind.DECODE, input_len, start=start, end=start + num)


def record(
    rid: str,
    client: str,
    arrival_s: float,
    *,
    input_len: int = 10,
    output_len: int = 5,
    prefix_len: int = 0,
    admit_s: float | None = None,
    first_token_s: float | None = None,
    finish_s: float | None = None,
    rejected: bool = False,
    interaction_id: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        rid=rid,
        client=client,
        arrival_s=arrival_s,
        input_len=input_len,
        output_len=output_len,
        num_output=output_len if finish_s is not None else 0,
        prefix_len=prefix_len,
        admit_s=admit_s,
        first_token_s=first_token_s,
        finish_s=finish_s,
        rejected=rejected,
        reject_reason="rpm" if rejected else None,
        num_retractions=0,
        service_class="be",
        interaction_id=interaction_id,
        app=None,
    )


# --- Jain ----------------------------------------------------------------------------------


def test_jain_hand_values():
    assert jain_index([1, 1]) == pytest.approx(1.0)
    assert jain_index([1, 0]) == pytest.approx(0.5)
    assert jain_index([3, 1]) == pytest.approx(16 / 20)  # (3+1)^2 / (2 * (9+1))
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)
    assert jain_index([0, 0, 0]) == 1.0  # documented: nobody got anything, equally
    with pytest.raises(ValueError):
        jain_index([])
    with pytest.raises(ValueError):
        jain_index([1, -1])


@given(
    st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=20).filter(
        lambda xs: sum(xs) > 1e-3
    ),
    st.floats(1e-3, 1e3),
)
def test_jain_bounds_and_scale_invariance(xs, scale):
    j = jain_index(xs)
    assert 1 / len(xs) - 1e-9 <= j <= 1 + 1e-9
    assert jain_index([x * scale for x in xs]) == pytest.approx(j, rel=1e-9)


# --- event arrays and service --------------------------------------------------------------


@dataclass(frozen=True)
class _ScalarOnlyCost(WeightedTokens):
    """A subclass: priced event by event (its methods could be scalar-only)."""

    def output_cost(self, *, input_len: int, start: int, end: int) -> float:
        return float(max(end - start, 0)) * 3.0


@pytest.mark.parametrize(
    "cost", [WeightedTokens(), PrefixAwareTokens(), ProfiledQuadratic(), _ScalarOnlyCost()]
)
def test_event_arrays_price_each_event_like_event_service(cost):
    rng = np.random.default_rng(0)
    events = []
    for i in range(200):
        t = float(rng.uniform(0, 50))
        client = f"c{rng.integers(0, 4)}"
        if rng.random() < 0.3:
            n = int(rng.integers(1, 100))
            events.append(prefill(t, client, n, extend_len=int(rng.integers(0, n + 1)), rid=str(i)))
        else:
            s = int(rng.integers(0, 50))
            events.append(decode(t, client, int(rng.integers(1, 8)), start=s, input_len=30))
    arrays = EventArrays.from_events(events, cost)
    assert list(arrays.t_s) == sorted(e.t_s for e in events)
    assert arrays.clients == tuple(sorted({e.client for e in events}))
    expected = {c: 0.0 for c in arrays.clients}
    for e in events:
        expected[e.client] += event_service(cost, e)
    got = per_client_service(arrays)
    assert got == pytest.approx(expected)
    with pytest.raises(ValueError):
        per_client_service(arrays, WeightedTokens(w_out=5.0))


@pytest.mark.parametrize("cost", [PrefixAwareTokens(), ProfiledQuadratic()])
def test_repriced_arrays_equal_arrays_built_under_that_cost(cost):
    rng = np.random.default_rng(1)
    events = [
        prefill(float(t), f"c{t % 3}", 40, extend_len=int(rng.integers(0, 41)), rid=str(t))
        if t % 4 == 0
        else decode(float(t % 17), f"c{t % 3}", 2, start=int(t), input_len=40)
        for t in range(120)
    ]  # many equal times: the stable order must carry over
    got = EventArrays.from_events(events, WeightedTokens()).repriced(cost)
    want = EventArrays.from_events(events, cost)
    assert got.cost is cost
    for field in ("t_s", "client_idx", "service", "is_prefill", "num_tokens"):
        assert np.array_equal(getattr(got, field), getattr(want, field)), field
    assert per_client_service(got) == pytest.approx(per_client_service(want))
    with pytest.raises(ValueError, match="from_events"):
        want.repriced(_ScalarOnlyCost())


def test_per_client_service_half_open_interval():
    events = [prefill(1.0, "a", 10), decode(2.0, "a", 5), prefill(3.0, "b", 7)]
    assert per_client_service(events) == {"a": 20.0, "b": 7.0}
    # [1, 3): the event at t0 counts, the one at t1 does not
    assert per_client_service(events, t0=1.0, t1=3.0) == {"a": 20.0, "b": 0.0}
    assert per_client_service(events, WeightedTokens(w_out=1.0), t0=1.5) == {"a": 5.0, "b": 7.0}


# a: 10 at t=0.5, 10 at t=1.5 (5 output tokens x 2); b: 20 at t=2.0
_SERIES_EVENTS = [prefill(0.5, "a", 10), decode(1.5, "a", 5), prefill(2.0, "b", 20)]


def test_service_rate_series_back_to_back_windows():
    times, rates = service_rate_series(_SERIES_EVENTS, window_s=1.0, t_end=3.0, clients="abz")
    np.testing.assert_allclose(times, [1.0, 2.0, 3.0])  # window ends
    np.testing.assert_allclose(rates["a"], [10, 10, 0])
    np.testing.assert_allclose(rates["b"], [0, 0, 20])
    np.testing.assert_allclose(rates["z"], [0, 0, 0])  # unknown client: zeros


def test_service_rate_series_sliding_windows():
    times, rates = service_rate_series(_SERIES_EVENTS, window_s=2.0, t_end=3.5, step_s=0.5)
    np.testing.assert_allclose(times, [2.0, 2.5, 3.0, 3.5])
    # a in [0,2) = 20, [0.5,2.5) = 20, [1,3) = 10, [1.5,3.5) = 10; per second: / 2
    np.testing.assert_allclose(rates["a"], [10, 10, 5, 5])
    np.testing.assert_allclose(rates["b"], [0, 10, 10, 10])
    times, _ = service_rate_series(_SERIES_EVENTS, window_s=5.0, t_end=3.0)
    assert times.size == 0  # only full windows


def test_service_rate_series_matches_naive_loop():
    rng = np.random.default_rng(1)
    events = [
        decode(float(rng.uniform(0, 100)), f"c{rng.integers(0, 3)}", int(rng.integers(1, 5)))
        for _ in range(500)
    ]
    times, rates = service_rate_series(events, window_s=7.0, t_end=100.0, step_s=3.0)
    for c, series in rates.items():
        for end, rate in zip(times, series, strict=True):
            naive = sum(
                2 * (e.end - e.start) for e in events if e.client == c and end - 7 <= e.t_s < end
            )
            assert rate == pytest.approx(naive / 7.0)


def test_accumulated_service_and_diff():
    times = [0.0, 0.5, 1.0, 2.0]
    acc = accumulated_service(_SERIES_EVENTS, times=times)
    np.testing.assert_allclose(acc["a"], [0, 10, 10, 20])  # t_s <= t counts
    np.testing.assert_allclose(acc["b"], [0, 0, 0, 20])
    diff = accumulated_service_diff(_SERIES_EVENTS, times=times, a="a", b="b")
    np.testing.assert_allclose(diff, [0, 10, 10, 0])


# --- active interval and Jain over it -------------------------------------------------------


def test_active_interval():
    recs = [record("1", "a", 0.0), record("2", "a", 5.0), record("3", "b", 2.0)]
    recs.append(record("4", "b", 8.0, rejected=True))  # rejected arrivals count
    assert active_interval(recs) == (2.0, 5.0)
    assert active_interval([record("1", "a", 0.0), record("2", "b", 1.0)]) is None  # inverted
    assert active_interval([]) is None


def test_jain_over_active_interval():
    recs = [record("1", "a", 0.0), record("2", "a", 5.0), record("3", "b", 2.0)]
    recs.append(record("4", "b", 8.0))
    events = [
        prefill(1.0, "a", 100),  # before the interval [2, 5)
        prefill(2.0, "a", 30),
        prefill(4.0, "b", 10),
        prefill(5.0, "b", 100),  # at its end: excluded
    ]
    # rates 10 and 10/3 per second: (40/3)^2 / (2 * (100 + 100/9)) = 0.8
    assert jain_over_active_interval(events, recs) == pytest.approx(0.8)
    assert jain_over_active_interval(events, recs[:1]) is None


# --- service difference --------------------------------------------------------------------

# Window 0 = [0, 10): a got 30 and asked 80 (10 + 2*35); b got 10 and asked 40 (10 + 2*15).
#   max_s = 30; a: min(0, 50) = 0; b: min(30 - 10, |40 - 10|) = 20  (gap branch).
# Window 1 = [10, 13]: a got 50 and asked 0; b got 10 and asked 12 (2 + 2*5).
#   max_s = 50; a: min(0, 50) = 0; b: min(50 - 10, |12 - 10|) = 2  (demand branch).
_DIFF_RECORDS = [
    record("a1", "a", 1.0, input_len=10, output_len=35),
    record("b1", "b", 3.0, input_len=10, output_len=15),
    record("b2", "b", 12.0, input_len=2, output_len=5),
]
_DIFF_EVENTS = [
    prefill(1.0, "a", 10),
    decode(2.0, "a", 10),
    prefill(3.0, "b", 10),
    decode(11.0, "a", 25, start=10),
    prefill(12.0, "b", 2),
    decode(13.0, "b", 4),  # at t_end: the last window is closed at t_end
]


def test_service_difference_two_windows_both_branches():
    starts, values = service_difference_windows(
        _DIFF_EVENTS, _DIFF_RECORDS, window_s=10.0, t_start=0.0
    )
    np.testing.assert_allclose(starts, [0.0, 10.0])
    np.testing.assert_allclose(values, [20.0, 2.0])
    diff = service_difference(_DIFF_EVENTS, _DIFF_RECORDS, window_s=10.0, t_start=0.0)
    assert diff == pytest.approx({"max": 20.0, "avg": 11.0, "var": 81.0})  # population var


def test_service_difference_respects_t_end_and_empty():
    # t_end = 10 ends in window 0 (closed at 10): the events at 11-13 are outside every window
    _, values = service_difference_windows(
        _DIFF_EVENTS, _DIFF_RECORDS, window_s=10.0, t_start=0.0, t_end=10.0
    )
    np.testing.assert_allclose(values, [20.0])
    assert service_difference([], []) == {"max": None, "avg": None, "var": None}


# --- latency, throughput, cache --------------------------------------------------------------


def test_percentiles_linear_and_empty():
    p = percentiles([4.0, 1.0, None, 3.0, float("nan"), 2.0])
    assert p[50] == pytest.approx(2.5)
    assert p[99] == pytest.approx(3.97)  # 1 + 0.99 * 3 = position 3.97 → 3.97
    assert percentiles([], qs=(50, 90)) == {50: None, 90: None}
    assert percentiles([None, float("nan")]) == {50: None, 99: None}


def test_per_client_latency():
    recs = [
        record("1", "a", 0.0, admit_s=0.0, first_token_s=1.0, finish_s=2.0),
        record("2", "a", 1.0, admit_s=1.0, first_token_s=4.0, finish_s=7.0),
        record("3", "b", 0.0, rejected=True),
        record("4", "b", 1.0, admit_s=1.5, first_token_s=2.0),  # still running
    ]
    lat = per_client_latency(recs)
    assert lat["a"]["ttft_p50_s"] == pytest.approx(2.0)  # ttft 1 and 3
    assert lat["a"]["e2e_p50_s"] == pytest.approx(4.0)  # e2e 2 and 6
    assert lat["a"]["e2e_p99_s"] == pytest.approx(2 + 0.99 * 4)
    assert (lat["a"]["num_finished"], lat["a"]["num_rejected"]) == (2, 0)
    assert lat["b"]["ttft_p50_s"] == pytest.approx(1.0)
    assert lat["b"]["e2e_p50_s"] is None
    assert (lat["b"]["num_requests"], lat["b"]["num_finished"], lat["b"]["num_rejected"]) == (
        2,
        0,
        1,
    )


def test_program_latency_needs_every_call_finished():
    recs = [
        record("1", "a", 0.0, finish_s=2.0, interaction_id="p"),
        record("2", "a", 1.0, finish_s=5.0, interaction_id="p"),
        record("3", "a", 1.0, finish_s=None, interaction_id="q"),
        record("4", "a", 1.0, finish_s=3.0),
    ]
    assert program_latency(recs) == {"p": 5.0}


def test_throughput_two_requests():
    recs = [
        record("1", "a", 0.0, input_len=10, output_len=5, finish_s=4.0),
        record("2", "b", 1.0, input_len=20, output_len=5, finish_s=10.0),
    ]
    events = [prefill(0.0, "a", 10), decode(4.0, "a", 5), prefill(1.0, "b", 20)]
    events.append(decode(10.0, "b", 5))
    # [0, 10]: 30 input + 10 output tokens, 2 requests
    assert throughput(recs, events) == pytest.approx(
        {"tok_s": 4.0, "input_tok_s": 3.0, "output_tok_s": 1.0, "req_s": 0.2}
    )
    # [2, 10]: only the two decode events and both finishes
    assert throughput(recs, events, t0=2.0, t1=10.0) == pytest.approx(
        {"tok_s": 1.25, "input_tok_s": 0.0, "output_tok_s": 1.25, "req_s": 0.25}
    )


def test_cache_hit_rate_counts_admitted_only():
    recs = [
        record("1", "a", 0.0, input_len=100, prefix_len=50, admit_s=0.0),
        record("2", "b", 0.0, input_len=100, prefix_len=0, admit_s=0.0),
        record("3", "b", 0.0, input_len=100, prefix_len=100, rejected=True),
        record("4", "b", 0.0, input_len=100, prefix_len=100),  # never admitted
    ]
    assert cache_hit_rate(recs) == pytest.approx(0.25)
    assert cache_hit_rate([]) == 0.0


# --- summarize -------------------------------------------------------------------------------


def _plain_json_types(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain_json_types(v) for k, v in value.items())
    return value is None or type(value) in (float, int, str, bool)


def test_summarize_is_json_row_with_required_keys():
    recs = [
        record("a1", "a", 0.0, admit_s=0.0, first_token_s=0.5, finish_s=2.0, prefix_len=4),
        record("b1", "b", 0.5, admit_s=0.5, first_token_s=1.0, finish_s=3.0),
        record("a2", "a", 1.0, admit_s=2.0, first_token_s=2.5, finish_s=4.0),
        record("b2", "b", 2.0, rejected=True),
    ]
    events = [
        prefill(0.0, "a", 10),
        prefill(0.5, "b", 10),
        decode(2.0, "a", 5),
        prefill(2.0, "a", 10),
        decode(3.0, "b", 5),
        decode(4.0, "a", 5),
    ]
    row = summarize(events, recs, window_s=2.0)
    json.dumps(row)
    assert _plain_json_types(row)
    required = {
        "throughput_tok_s",
        "throughput_req_s",
        "jain",
        "service_diff_max",
        "service_diff_avg",
        "service_diff_var",
        "ttft_p50_s",
        "ttft_p99_s",
        "e2e_p50_s",
        "e2e_p99_s",
        "cache_hit_rate",
        "num_finished",
        "num_rejected",
        "clients",
    }
    assert required <= row.keys()
    assert (row["num_finished"], row["num_rejected"]) == (3, 1)
    assert row["cache_hit_rate"] == pytest.approx(4 / 30)
    assert row["throughput_req_s"] == pytest.approx(3 / 4)
    # active interval [0.5, 1.0): only b's prefill lands in it, so Jain = 1/2
    assert row["jain_scope"] == "active"
    assert row["jain"] == pytest.approx(0.5)
    assert set(row["clients"]) == {"a", "b"}
    assert row["clients"]["a"]["service"] == pytest.approx(40.0)
    assert row["clients"]["b"]["num_rejected"] == 1
    assert not math.isnan(row["service_diff_max"])


def test_summarize_empty_run_is_json():
    row = summarize([], [])
    json.dumps(row)
    assert row["jain"] is None and row["clients"] == {}
