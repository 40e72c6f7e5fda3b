import math

import numpy as np
import pytest

from sgl_fair.workloads.arrivals import (
    Constant,
    Gamma,
    LinearRamp,
    OnOff,
    Phases,
    Poisson,
    Silent,
    per_minute,
)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def assert_sorted_in_window(times: list[float], start_s: float, end_s: float) -> None:
    assert all(isinstance(t, float) for t in times)
    assert times == sorted(times)
    assert all(start_s <= t < end_s for t in times)


def test_per_minute():
    assert per_minute(90) == 1.5


def test_constant_is_evenly_spaced_from_start():
    times = Constant(4.0).times(10.0, 13.0, rng())
    assert len(times) == 12  # exactly rate * span: 10.0, 10.25, ..., 12.75
    assert times[0] == 10.0
    np.testing.assert_allclose(np.diff(times), 0.25)
    assert_sorted_in_window(times, 10.0, 13.0)


def test_constant_count_is_exact_for_awkward_rates():
    for rate, span in [(3.0, 7.0), (per_minute(7), 600.0), (0.1, 1.0), (1 / 3, 9.0)]:
        times = Constant(rate).times(0.0, span, rng())
        assert len(times) == math.ceil(rate * span - 1e-9), (rate, span)


@pytest.mark.parametrize("process", [Constant(5.0), Poisson(5.0), Gamma(5.0, 2.0)])
def test_empty_or_zero_windows(process):
    assert process.times(3.0, 3.0, rng()) == []
    assert process.times(3.0, 1.0, rng()) == []
    assert type(process)(0.0).times(0.0, 100.0, rng()) == []


def test_poisson_count_and_dispersion():
    rate, span = 5.0, 10_000.0
    times = Poisson(rate).times(0.0, span, rng(1))
    assert_sorted_in_window(times, 0.0, span)
    expected = rate * span
    assert abs(len(times) - expected) < 5 * math.sqrt(expected)
    # Counts per 1 s bin: variance / mean = 1 for Poisson (it would be ~0 for Constant).
    counts = np.bincount(np.floor(times).astype(int), minlength=int(span))
    assert 0.9 < counts.var() / counts.mean() < 1.1
    # Inter-arrival CV of an exponential is 1.
    gaps = np.diff(times)
    assert 0.97 < gaps.std() / gaps.mean() < 1.03


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_gamma_rate_and_cv(cv):
    rate, span = 20.0, 5_000.0
    times = Gamma(rate, cv).times(100.0, 100.0 + span, rng(2))
    assert_sorted_in_window(times, 100.0, 100.0 + span)
    expected = rate * span
    # A renewal count has variance ~ cv^2 * mean.
    assert abs(len(times) - expected) < 5 * cv * math.sqrt(expected)
    gaps = np.diff(times)
    assert abs(gaps.mean() - 1 / rate) < 0.03 / rate
    assert abs(gaps.std() / gaps.mean() - cv) < 0.05 * cv


def test_gamma_cv_zero_is_evenly_spaced():
    times = Gamma(2.0, 0.0).times(0.0, 10.0, rng())
    np.testing.assert_allclose(np.diff(times), 0.5)
    assert len(times) == 19  # first arrival one gap after start


def test_same_rng_seed_same_times():
    for process in [Poisson(3.0), Gamma(3.0, 2.5), LinearRamp(1.0, 9.0, poisson=True)]:
        assert process.times(0.0, 50.0, rng(7)) == process.times(0.0, 50.0, rng(7))
        assert process.times(0.0, 50.0, rng(7)) != process.times(0.0, 50.0, rng(8))


@pytest.mark.parametrize("start_on", [True, False])
def test_on_off_has_no_arrivals_in_off_periods(start_on):
    on_s, off_s, start = 2.0, 3.0, 50.0
    times = OnOff(Poisson(50.0), on_s, off_s, start_on=start_on).times(start, start + 1000, rng(3))
    assert_sorted_in_window(times, start, start + 1000)
    phase = (np.asarray(times) - start) % (on_s + off_s)
    if start_on:
        assert np.all(phase < on_s)
    else:
        assert np.all(phase >= off_s)
    # 200 ON periods of 2 s at 50/s.
    assert abs(len(times) - 20_000) < 5 * math.sqrt(20_000)


def test_on_off_restarts_inner_at_each_on_period_and_truncates_at_end():
    times = OnOff(Constant(1.0), on_s=2.0, off_s=3.0).times(0.0, 11.0, rng())
    assert times == [0.0, 1.0, 5.0, 6.0, 10.0]


def test_linear_ramp_deterministic_count_and_increasing_density():
    rate_start, rate_end, span = 10.0, 110.0, 100.0
    times = LinearRamp(rate_start, rate_end).times(5.0, 5.0 + span, rng())
    assert_sorted_in_window(times, 5.0, 5.0 + span)
    integral = (rate_start + rate_end) / 2 * span
    assert len(times) == math.ceil(integral)
    assert times[0] == 5.0
    gaps = np.diff(times)
    assert np.all(np.diff(gaps) < 1e-9)  # gaps shrink: density rises
    # The k-th arrival is where the integrated intensity reaches k.
    u = np.asarray(times) - 5.0
    integrated = rate_start * u + (rate_end - rate_start) * u**2 / (2 * span)
    np.testing.assert_allclose(integrated, np.arange(len(times)), atol=1e-6)
    # Local rate near the end is ~ rate_end.
    assert abs(1 / gaps[-1] - rate_end) < 1.0


def test_linear_ramp_down_and_flat():
    times = LinearRamp(100.0, 0.0).times(0.0, 10.0, rng())
    assert len(times) == 500
    assert np.all(np.diff(np.diff(times)) > -1e-9)  # gaps grow: density falls
    flat = LinearRamp(4.0, 4.0).times(1.0, 11.0, rng())
    np.testing.assert_allclose(flat, Constant(4.0).times(1.0, 11.0, rng()))


def test_linear_ramp_poisson_follows_intensity():
    span = 1000.0
    times = np.asarray(LinearRamp(0.0, 40.0, poisson=True).times(0.0, span, rng(4)))
    assert_sorted_in_window(times.tolist(), 0.0, span)
    assert abs(len(times) - 20_000) < 5 * math.sqrt(20_000)
    # Intensity 40 t / span: the quarters hold 1/16, 3/16, 5/16, 7/16 of the arrivals.
    quarters = np.bincount((times // (span / 4)).astype(int), minlength=4) / len(times)
    np.testing.assert_allclose(quarters, [1 / 16, 3 / 16, 5 / 16, 7 / 16], atol=0.01)


def test_phases_respect_boundaries():
    process = Phases(((10.0, Poisson(20.0)), (5.0, None), (4.0, Constant(2.0)), (3.0, Silent())))
    assert process.duration_s == 22.0
    times = np.asarray(process.times(100.0, 500.0, rng(5)))
    first = times[times < 110.0]
    assert abs(len(first) - 200) < 5 * math.sqrt(200)
    assert not np.any((times >= 110.0) & (times < 115.0))
    np.testing.assert_allclose(
        times[times >= 115.0], [115, 115.5, 116, 116.5, 117, 117.5, 118, 118.5]
    )
    assert times.max() < 119.0  # silent phase, then nothing after the last phase


def test_phases_truncated_by_window_end():
    process = Phases(((2.0, Constant(1.0)), (10.0, Constant(1.0))))
    assert process.times(0.0, 5.0, rng()) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert process.times(0.0, 1.5, rng()) == [0.0, 1.0]


def test_phase_ramp_spans_its_own_phase():
    times = Phases(((5.0, Silent()), (10.0, LinearRamp(0.0, 20.0)))).times(0.0, 100.0, rng())
    assert len(times) == 100 and times[0] == 5.0 and times[-1] < 15.0


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: Constant(-1.0), "rate_per_s"),
        (lambda: Poisson(-0.5), "rate_per_s"),
        (lambda: Poisson(float("nan")), "rate_per_s"),
        (lambda: Gamma(-1.0, 1.0), "rate_per_s"),
        (lambda: Gamma(1.0, -0.1), "cv"),
        (lambda: OnOff(Poisson(1.0), on_s=-1.0, off_s=1.0), "on_s"),
        (lambda: OnOff(Poisson(1.0), on_s=1.0, off_s=-1.0), "off_s"),
        (lambda: OnOff(Poisson(1.0), on_s=0.0, off_s=0.0), "on_s"),
        (lambda: LinearRamp(-1.0, 1.0), "rate_start_per_s"),
        (lambda: LinearRamp(1.0, -1.0), "rate_end_per_s"),
        (lambda: Phases(((1.0, None), (-2.0, Poisson(1.0)))), "phases[1].duration_s"),
    ],
)
def test_invalid_parameters_name_the_field(make, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        make()
