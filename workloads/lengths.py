"""Token-length distributions for prompts and outputs.

Each is a small frozen dataclass with ``sample(n, rng) -> numpy int64 array`` whose values
are all >= 1. All randomness comes from the ``numpy.random.Generator`` passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class LengthDist(Protocol):
    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray: ...


def _check_int(owner: object, name: str, value: object, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{type(owner).__name__}: field {name!r} must be an integer")
    if value < minimum:
        raise ValueError(
            f"{type(owner).__name__}: field {name!r} must be >= {minimum} (got {value})"
        )


def _check_real(owner: object, name: str, value: object, *, positive: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{type(owner).__name__}: field {name!r} must be {bound} (got {value})")


def _clip_round(x: np.ndarray, lo: int, hi: int | None) -> np.ndarray:
    return np.clip(np.rint(x), lo, hi if hi is not None else None).astype(np.int64)


@dataclass(frozen=True)
class Fixed:
    n: int

    def __post_init__(self) -> None:
        _check_int(self, "n", self.n)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, self.n, dtype=np.int64)


@dataclass(frozen=True)
class Uniform:
    """Uniform over the integers ``lo..hi`` inclusive."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        _check_int(self, "lo", self.lo)
        _check_int(self, "hi", self.hi, minimum=self.lo)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(self.lo, self.hi, size=n, endpoint=True, dtype=np.int64)


@dataclass(frozen=True)
class Normal:
    """Normal, rounded to the nearest integer and clipped to ``[lo, hi]``."""

    mean: float
    std: float
    lo: int = 1
    hi: int | None = None

    def __post_init__(self) -> None:
        _check_real(self, "mean", self.mean)
        _check_real(self, "std", self.std)
        _check_int(self, "lo", self.lo)
        if self.hi is not None:
            _check_int(self, "hi", self.hi, minimum=self.lo)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return _clip_round(rng.normal(self.mean, self.std, n), self.lo, self.hi)


@dataclass(frozen=True)
class LogNormal:
    """Log-normal with the given ``mean`` (of the lengths, before clipping) and ``sigma`` (of
    the underlying normal; larger is heavier-tailed), rounded and clipped to ``[lo, hi]``.
    """

    mean: float
    sigma: float
    lo: int = 1
    hi: int | None = None

    def __post_init__(self) -> None:
        _check_real(self, "mean", self.mean, positive=True)
        _check_real(self, "sigma", self.sigma)
        _check_int(self, "lo", self.lo)
        if self.hi is not None:
            _check_int(self, "hi", self.hi, minimum=self.lo)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        mu = math.log(self.mean) - self.sigma**2 / 2  # E[exp(N(mu, s^2))] = exp(mu + s^2/2)
        return _clip_round(rng.lognormal(mu, self.sigma, n), self.lo, self.hi)


@dataclass(frozen=True)
class Empirical:
    """Drawn uniformly (with replacement) from observed ``values``, e.g. a dataset's lengths."""

    values: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(self.values))
        if not self.values:
            raise ValueError("Empirical: field 'values' must not be empty")
        for i, v in enumerate(self.values):
            _check_int(self, f"values[{i}]", v)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.asarray(self.values, dtype=np.int64)[rng.integers(0, len(self.values), n)]


def as_length_dist(x: LengthDist | int) -> LengthDist:
    """A plain int means :class:`Fixed`."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return Fixed(int(x))
    if not isinstance(x, LengthDist):
        raise TypeError(f"expected a length distribution or an int, got {type(x).__name__}")
    return x
