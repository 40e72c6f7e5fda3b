"""Service cost functions: how much "service" a client received.

Fairness equalises service, so its measure is a first-class object (SPEC §0).
A cost function prices the two things a request consumes:

* ``input_cost(input_len=, extend_len=)`` — charged once, at admission;
* ``output_cost(input_len=, start=, end=)`` — output tokens ``[start, end)``.

Splitting output cost by token range lets a non-linear cost (the VTC paper's
profiled quadratic) be charged token by token as decoding proceeds and refunded
exactly (VTC with length prediction).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from sgl_fair.records import EventKind, ServiceEvent


@runtime_checkable
class CostFunction(Protocol):
    def input_cost(self, *, input_len: int, extend_len: int) -> float: ...

    def output_cost(self, *, input_len: int, start: int, end: int) -> float: ...


@dataclass(frozen=True)
class WeightedTokens:
    """VTC's weighted token count: ``w_in * input_tokens + w_out * output_tokens``.

    Defaults follow both papers (after OpenAI pricing): ``w_in = 1``, ``w_out = 2``.
    Cached prefix tokens are charged like any other input token.
    """

    w_in: float = 1.0
    w_out: float = 2.0

    def input_cost(self, *, input_len: int, extend_len: int) -> float:
        return self.w_in * input_len

    def output_cost(self, *, input_len: int, start: int, end: int) -> float:
        return self.w_out * (end - start)


@dataclass(frozen=True)
class PrefixAwareTokens:
    """DLPM's prefix-aware cost: ``w_e * extend_tokens + w_out * output_tokens``.

    ``extend_tokens = input_len - matched_prefix_len`` at admission, so a cache
    hit is cheap for the client as it is for the GPU.
    """

    w_extend: float = 1.0
    w_out: float = 2.0

    def input_cost(self, *, input_len: int, extend_len: int) -> float:
        return self.w_extend * extend_len

    def output_cost(self, *, input_len: int, start: int, end: int) -> float:
        return self.w_out * (end - start)


@dataclass(frozen=True)
class ProfiledQuadratic:
    """The VTC paper's profiled cost (App. B.2), a quadratic fit of measured time:

    ``h(n_p, n_q) = a*n_p + b*n_q + c*n_p*n_q + d*n_q**2 + e``

    with ``n_p`` input and ``n_q`` output tokens. ``h(n_p, 0)`` is charged at
    admission and ``h(n_p, end) - h(n_p, start)`` for output tokens
    ``[start, end)``, so the total for a finished request is exactly ``h``.
    The defaults are the coefficients published for Llama-2-7B on A10G scaled ×10 and
    rounded (``"profiled"``); ``profiled_spec()`` (``"profiled-spec"``) has them exactly as
    SPEC §1 writes them.
    """

    a: float = 2.1
    b: float = 1.0
    c: float = 0.04
    d: float = 0.032
    e: float = 11.3

    def h(self, n_p: int, n_q: int) -> float:
        return self.a * n_p + self.b * n_q + self.c * n_p * n_q + self.d * n_q * n_q + self.e

    def input_cost(self, *, input_len: int, extend_len: int) -> float:
        return self.h(input_len, 0)

    def output_cost(self, *, input_len: int, start: int, end: int) -> float:
        return self.h(input_len, end) - self.h(input_len, start)


def event_service(cost: CostFunction, event: ServiceEvent) -> float:
    """Service units an event represents under ``cost``."""
    if event.kind is EventKind.PREFILL:
        return cost.input_cost(input_len=event.input_len, extend_len=event.extend_len)
    return cost.output_cost(input_len=event.input_len, start=event.start, end=event.end)


# SPEC §1's profiled cost, from the VTC artifact (Llama-2-7B on A10G), as written there:
# h(x, y) = 0.21001891x + 0.10075395y + 0.0039868xy + 0.00324733y² + 1.14601454
SPEC_PROFILED = {
    "a": 0.21001891,
    "b": 0.10075395,
    "c": 0.0039868,
    "d": 0.00324733,
    "e": 1.14601454,
}


def profiled_spec(**overrides: float) -> ProfiledQuadratic:
    """The profiled quadratic with SPEC §1's coefficients exactly (``"profiled-spec"``)."""
    return ProfiledQuadratic(**{**SPEC_PROFILED, **overrides})


COSTS: dict[str, Callable[..., CostFunction]] = {
    "weighted": WeightedTokens,
    "prefix": PrefixAwareTokens,
    "profiled": ProfiledQuadratic,  # SPEC's coefficients x 10, rounded
    "profiled-spec": profiled_spec,  # SPEC's coefficients as written
}


def resolve_cost(cost: CostFunction | str) -> CostFunction:
    """A policy's ``cost`` option: a cost object, or one of ``COSTS`` by name."""
    return make_cost(cost) if isinstance(cost, str) else cost


def make_cost(name: str, **kwargs: float) -> CostFunction:
    try:
        return COSTS[name](**kwargs)
    except KeyError:
        raise ValueError(f"unknown cost function {name!r}; choose one of {sorted(COSTS)}") from None
