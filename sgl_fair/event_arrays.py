"""A run's service events as numpy arrays, priced once: what every event metric reads.

Runs can hold ~10^6 events (one per generated token). ``EventArrays.from_events`` reads
them once (time, client index, token counts) and prices them under a ``CostFunction``;
``repriced`` prices the same arrays under another cost. ``sgl_fair.metrics`` accepts either
raw events or an ``EventArrays`` wherever it reads events.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from operator import attrgetter

import numpy as np

from sgl_fair.cost import (
    CostFunction,
    PrefixAwareTokens,
    ProfiledQuadratic,
    WeightedTokens,
    event_service,
)
from sgl_fair.records import EventKind, ServiceEvent
from sgl_fair.request import ClientId

# Cost types whose methods are plain arithmetic, so they accept numpy arrays unchanged.
# Exact types only: a subclass may override a method with scalar-only code.
_VECTORISABLE_COSTS = (WeightedTokens, PrefixAwareTokens, ProfiledQuadratic)


_COLUMNS = np.dtype(
    [("t_s", "f8"), ("input_len", "f8"), ("extend_len", "f8"), ("start", "f8"), ("end", "f8")]
)
_columns_of = attrgetter("t_s", "input_len", "extend_len", "start", "end")


@dataclass(frozen=True, eq=False)
class EventArrays:
    """Service events as arrays, sorted by time (stable), priced once under ``cost``.

    ``clients`` is sorted; ``client_idx[i]`` indexes it. ``num_tokens`` is ``input_len`` for
    a PREFILL event and ``end - start`` for a DECODE event (used by ``throughput``).
    ``columns`` keeps each event's token counts, so ``repriced`` prices them again under
    another cost without going back to the events.
    """

    cost: CostFunction
    clients: tuple[ClientId, ...]
    t_s: np.ndarray
    client_idx: np.ndarray
    service: np.ndarray
    is_prefill: np.ndarray
    num_tokens: np.ndarray
    columns: np.ndarray  # structured, ``_COLUMNS``, in the same (time) order

    @classmethod
    def from_events(
        cls, events: Sequence[ServiceEvent], cost: CostFunction | None = None
    ) -> EventArrays:
        cost = WeightedTokens() if cost is None else cost
        n = len(events)
        cols = np.fromiter(map(_columns_of, events), dtype=_COLUMNS, count=n)
        prefill = EventKind.PREFILL
        is_prefill = np.fromiter((ev.kind is prefill for ev in events), dtype=bool, count=n)
        first_seen: dict[ClientId, int] = {}
        seen = first_seen.setdefault
        seen_idx = np.fromiter(
            (seen(c, len(first_seen)) for c in map(attrgetter("client"), events)), np.int64, n
        )
        if type(cost) in _VECTORISABLE_COSTS:
            service = _vector_service(cost, cols, is_prefill)
        else:
            service = np.fromiter((event_service(cost, ev) for ev in events), np.float64, n)
        clients = sorted(first_seen)
        rank = np.empty(len(clients), dtype=np.int64)
        rank[[first_seen[c] for c in clients]] = np.arange(len(clients))
        order = np.argsort(cols["t_s"], kind="stable")
        cols, is_prefill = cols[order], is_prefill[order]
        return cls(
            cost=cost,
            clients=tuple(clients),
            t_s=cols["t_s"],
            client_idx=rank[seen_idx[order]],
            service=service[order],
            is_prefill=is_prefill,
            num_tokens=np.where(is_prefill, cols["input_len"], cols["end"] - cols["start"]),
            columns=cols,
        )

    def repriced(self, cost: CostFunction) -> EventArrays:
        """The same events priced under ``cost`` (one of the vectorisable costs; any other
        needs ``from_events``)."""
        if type(cost) not in _VECTORISABLE_COSTS:
            raise ValueError(f"{type(cost).__name__} is not priced column-wise: use from_events")
        service = _vector_service(cost, self.columns, self.is_prefill)
        return replace(self, cost=cost, service=service)

    def __len__(self) -> int:
        return len(self.t_s)

    @cached_property
    def _by_client(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Times sorted by (client, time), the running service sum in that order (with a
        leading 0), and each client's segment bounds."""
        order = np.lexsort((self.t_s, self.client_idx))
        cum = np.concatenate(([0.0], np.cumsum(self.service[order])))
        bounds = np.searchsorted(self.client_idx[order], np.arange(len(self.clients) + 1))
        return self.t_s[order], cum, bounds

    def cumulative(self, times: np.ndarray, *, inclusive: bool) -> np.ndarray:
        """Per-client cumulative service at ``times``: shape ``(len(clients), len(times))``.

        ``inclusive`` counts events with ``t_s <= t``, otherwise ``t_s < t``.
        """
        times = np.asarray(times, dtype=np.float64)
        side = "right" if inclusive else "left"
        out = np.zeros((len(self.clients), len(times)))
        seg_t, cum, bounds = self._by_client
        for c, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            idx = lo + np.searchsorted(seg_t[lo:hi], times, side=side)
            out[c] = cum[idx] - cum[lo]
        return out


def _vector_service(cost: CostFunction, cols: np.ndarray, is_prefill: np.ndarray) -> np.ndarray:
    return np.where(
        is_prefill,
        cost.input_cost(input_len=cols["input_len"], extend_len=cols["extend_len"]),
        cost.output_cost(input_len=cols["input_len"], start=cols["start"], end=cols["end"]),
    ).astype(np.float64)


def as_arrays(
    events: Sequence[ServiceEvent] | EventArrays, cost: CostFunction | None
) -> EventArrays:
    """``events`` as arrays priced under ``cost`` (arrays already priced under it as they are)."""
    if isinstance(events, EventArrays):
        if cost is not None and cost != events.cost:
            raise ValueError("EventArrays was priced under a different cost function")
        return events
    return EventArrays.from_events(events, cost)
