"""Router × local policy pairings under the labels the papers use (``D2LPM``, ``VTC``, …).

The cluster experiments run them; the live load test labels a server's configuration with
the same names, so simulated and live rows line up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Combo:
    """A router policy paired with a local (worker) policy."""

    label: str
    router: str
    local: str
    router_opts: Mapping[str, Any] = field(default_factory=dict)
    local_opts: Mapping[str, Any] = field(default_factory=dict)


D2LPM = Combo("D2LPM", "d2lpm", "dlpm")
RR_LPM = Combo("RR+LPM", "rr", "lpm")
PREBLE = Combo("Preble", "preble", "preble-local")  # Preble's router over its own local scheduler
VTC = Combo("VTC", "per-client-rr", "vtc")
CACHE_AWARE = Combo("CacheAware+LPM", "cache-aware", "lpm")
GRID_COMBOS = (D2LPM, RR_LPM, PREBLE, VTC, CACHE_AWARE)
# D2LPM at the paper's setting (its rounds, Q_u = 10,000) beside the defaults above (sliding
# deficits, Q_u = 300,000: what the live server runs); ``d2lpm-grid`` runs both.
D2LPM_PAPER = Combo(
    "D2LPM-paper", "d2lpm", "dlpm", router_opts={"deficits": "rounds", "quantum": 10_000.0}
)
# One GPU: the router is irrelevant, only the local policy differs.
LPM1 = Combo("LPM", "rr", "lpm")
VTC1 = Combo("VTC", "rr", "vtc")
DLPM1 = Combo("DLPM", "rr", "dlpm")
NAMED_COMBOS = (*GRID_COMBOS, LPM1, VTC1, DLPM1)


def label_of(router: str | None, local: str | None) -> str | None:
    """The named pairing's label for (router, local), or None."""
    for combo in NAMED_COMBOS:
        if (combo.router, combo.local) == (router, local):
            return combo.label
    return None
