"""Open-loop arrival processes.

Each process is a small frozen dataclass with one method::

    times(start_s, end_s, rng) -> sorted list of arrival times in [start_s, end_s)

Processes hold no state, so one instance can describe many clients; all randomness comes
from the ``numpy.random.Generator`` passed in. Rates are per second; papers usually give
them per minute, hence :func:`per_minute`.

Composition::

    OnOff(Poisson(per_minute(90)), on_s=60, off_s=120)          # bursty client
    Phases(((300, Poisson(2.0)), (300, None), (300, Gamma(4.0, cv=3))))  # distribution shift
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class ArrivalProcess(Protocol):
    def times(self, start_s: float, end_s: float, rng: np.random.Generator) -> list[float]: ...


def per_minute(x: float) -> float:
    """A rate given per minute, as the per-second rate the processes take."""
    return x / 60.0


def _check_nonneg(owner: object, name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{type(owner).__name__}: field {name!r} must be a finite number")
    if value < 0:
        raise ValueError(f"{type(owner).__name__}: field {name!r} must be >= 0 (got {value})")


def _in_window(times: np.ndarray, start_s: float, end_s: float) -> list[float]:
    # Rounding in `start + offset` may land exactly on end_s; the window is half-open.
    return times[(times >= start_s) & (times < end_s)].tolist()


@dataclass(frozen=True)
class Silent:
    """No arrivals: an idle phase."""

    def times(self, start_s: float, end_s: float, rng: np.random.Generator) -> list[float]:
        return []


@dataclass(frozen=True)
class Constant:
    """Evenly spaced arrivals, the first at ``start_s``: ``start_s + k / rate``."""

    rate_per_s: float

    def __post_init__(self) -> None:
        _check_nonneg(self, "rate_per_s", self.rate_per_s)

    def times(self, start_s: float, end_s: float, rng: np.random.Generator) -> list[float]:
        span = end_s - start_s
        if span <= 0 or self.rate_per_s == 0:
            return []
        num = math.ceil(span * self.rate_per_s) + 1  # one spare; the window filter trims it
        return _in_window(start_s + np.arange(num) / self.rate_per_s, start_s, end_s)


@dataclass(frozen=True)
class Poisson:
    """Homogeneous Poisson process (exponential inter-arrival times)."""

    rate_per_s: float

    def __post_init__(self) -> None:
        _check_nonneg(self, "rate_per_s", self.rate_per_s)

    def times(self, start_s: float, end_s: float, rng: np.random.Generator) -> list[float]:
        span = end_s - start_s
        if span <= 0 or self.rate_per_s == 0:
            return []
        # Given the count, Poisson arrivals are i.i.d. uniform over the window.
        num = rng.poisson(self.rate_per_s * span)
        return _in_window(np.sort(rng.uniform(start_s, end_s, num)), start_s, end_s)


@dataclass(frozen=True)
class Gamma:
    """Renewal process with Gamma inter-arrival times: mean ``1/rate``, coefficient of
    variation ``cv`` (cv=1 is Poisson, cv>1 burstier, cv=0 evenly spaced).

    The first arrival comes one inter-arrival time after ``start_s``.
    """

    rate_per_s: float
    cv: float = 1.0

    def __post_init__(self) -> None:
        _check_nonneg(self, "rate_per_s", self.rate_per_s)
        _check_nonneg(self, "cv", self.cv)

    def _gaps(self, num: int, rng: np.random.Generator) -> np.ndarray:
        mean_gap = 1.0 / self.rate_per_s
        if self.cv == 0:
            return np.full(num, mean_gap)
        shape = 1.0 / self.cv**2
        return rng.gamma(shape, mean_gap / shape, num)

    def times(self, start_s: float, end_s: float, rng: np.random.Generator) -> list[float]:
        span = end_s - start_s
        if span <= 0 or self.rate_per_s == 0:
            return []
        expected = self.rate_per_s * span
        chunk = int(expected + 6 * max(self.cv, 1.0) * math.sqrt(expected) + 16)
        offsets = np.cumsum(self._gaps(chunk, rng))
        while offsets[-1] < span:  # rare: draw more until the window is covered
            offsets = np.concatenate([offsets, offsets[-1] + np.cumsum(self._gaps(chunk, rng))])
        return _in_window(start_s + offsets[offsets < span], start_s, end_s)


@dataclass(frozen=True)
class OnOff:
    """``inner`` is active only in ON periods; ON (``on_s``) and OFF (``off_s``) alternate
    from ``start_s``, beginning with ON unless ``start_on`` is False.

    The inner process restarts at each ON period (a Constant inner fires at each ON start).
    """

    inner: ArrivalProcess
    on_s: float
    off_s: float
    start_on: bool = True

    def __post_init__(self) -> None:
        _check_nonneg(self, "on_s", self.on_s)
        _check_nonneg(self, "off_s", self.off_s)
        if self.on_s + self.off_s <= 0:
            raise ValueError("OnOff: fields 'on_s' and 'off_s' must not both be 0")

    def times(self, start_s: float, end_s: float, rng: np.random.Generator) -> list[float]:
        out: list[float] = []
        first_on_s = start_s if self.start_on else start_s + self.off_s
        period_s = self.on_s + self.off_s
        k = 0
        # Period starts are computed by multiplication so long runs do not drift.
        while (on_start_s := first_on_s + k * period_s) < end_s:
            k += 1
            on_end_s = min(on_start_s + self.on_s, first_on_s + k * period_s, end_s)
            if on_end_s > on_start_s:
                out.extend(self.inner.times(on_start_s, on_end_s, rng))
        return out


@dataclass(frozen=True)
class LinearRamp:
    """Intensity rising (or falling) linearly from ``rate_start_per_s`` at ``start_s`` to
    ``rate_end_per_s`` at ``end_s``: the ramp always spans the window it is asked about.

    Deterministic (default): the k-th arrival (k = 0, 1, ...) is where the integrated
    intensity reaches k, so the first is at ``start_s`` and a flat ramp equals
    :class:`Constant`. ``poisson=True``: a non-homogeneous Poisson process with that
    intensity (by time rescaling).
    """

    rate_start_per_s: float
    rate_end_per_s: float
    poisson: bool = False

    def __post_init__(self) -> None:
        _check_nonneg(self, "rate_start_per_s", self.rate_start_per_s)
        _check_nonneg(self, "rate_end_per_s", self.rate_end_per_s)

    def times(self, start_s: float, end_s: float, rng: np.random.Generator) -> list[float]:
        span = end_s - start_s
        a, b = self.rate_start_per_s, self.rate_end_per_s
        total = (a + b) / 2 * span  # integrated intensity over the window
        if span <= 0 or total == 0:
            return []
        if self.poisson:
            levels = np.sort(rng.uniform(0.0, total, rng.poisson(total)))
        else:
            levels = np.arange(math.ceil(total), dtype=float)
        # Solve a*u + c*u^2 = level with c = (b - a) / (2 span); this root form is stable for
        # c = 0 and c < 0 and never divides by zero except at level 0 with a = 0.
        c = (b - a) / (2 * span)
        disc = np.sqrt(np.maximum(a * a + 4 * c * levels, 0.0))
        denom = a + disc
        with np.errstate(divide="ignore", invalid="ignore"):
            u = np.where(levels == 0, 0.0, 2 * levels / denom)
        return _in_window(start_s + u, start_s, end_s)


@dataclass(frozen=True)
class Phases:
    """Consecutive phases ``((duration_s, process), ...)`` from ``start_s``; a ``None``
    process (or :class:`Silent`) is an idle phase. Nothing arrives after the last phase.
    Each phase's process sees its own window, so e.g. a :class:`LinearRamp` ramps across
    its phase only (truncated where ``end_s`` cuts the phase short).
    """

    phases: tuple[tuple[float, ArrivalProcess | None], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "phases", tuple(tuple(p) for p in self.phases))
        for i, phase in enumerate(self.phases):
            if len(phase) != 2:
                raise ValueError(f"Phases: phase {i} must be (duration_s, process)")
            _check_nonneg(self, f"phases[{i}].duration_s", phase[0])

    @property
    def duration_s(self) -> float:
        return float(sum(d for d, _ in self.phases))

    def times(self, start_s: float, end_s: float, rng: np.random.Generator) -> list[float]:
        out: list[float] = []
        # One list of boundaries, so adjacent phases meet exactly (no gap, no overlap).
        bounds = start_s + np.concatenate([[0.0], np.cumsum([d for d, _ in self.phases])])
        for i, (_, process) in enumerate(self.phases):
            lo, hi = float(bounds[i]), min(float(bounds[i + 1]), end_s)
            if lo >= end_s:
                break
            if process is not None and hi > lo:
                out.extend(process.times(lo, hi, rng))
        return out
