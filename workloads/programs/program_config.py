"""Program configs: the checks a kind's frozen dataclass config runs (errors name the field),
the :func:`length` field and :class:`ProgramConfig` base, and length sampling. ``base.py``
re-exports these names."""

from __future__ import annotations

import math
from dataclasses import field, fields
from typing import Any

import numpy as np

from ..lengths import LengthDist, as_length_dist


def check_int(owner: object, name: str, *, minimum: int, maximum: int | None = None) -> None:
    value = getattr(owner, name)
    ok = not isinstance(value, bool) and isinstance(value, (int, np.integer))
    if not ok or value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{type(owner).__name__}: field {name!r} must be an integer {bound}")


def check_real(owner: object, name: str, *, positive: bool = False) -> None:
    value = getattr(owner, name)
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{type(owner).__name__}: field {name!r} must be a number {bound}")


def check_length(owner: object, name: str, *, allow_zero: bool = False) -> None:
    """A length field: a ``LengthDist`` or an int (made :class:`Fixed`); with ``allow_zero``,
    0 means "none" and is kept as 0."""
    value = getattr(owner, name)
    if allow_zero and not isinstance(value, bool) and isinstance(value, int) and value == 0:
        return
    try:
        object.__setattr__(owner, name, as_length_dist(value))
    except (TypeError, ValueError):
        raise ValueError(
            f"{type(owner).__name__}: field {name!r} must be a length distribution or an "
            f"integer >= {0 if allow_zero else 1} (got {value!r})"
        ) from None


def length(default: LengthDist | int, *, allow_zero: bool = False) -> Any:
    """A :class:`ProgramConfig` field holding a length (see :func:`check_length`)."""
    return field(default=default, metadata={"length": {"allow_zero": allow_zero}})


class ProgramConfig:
    """Base of the frozen dataclass configs of the kinds that open with the client's header.

    Such a config has an integer ``header_len`` field (>= 0); its :func:`length` fields are
    checked in field order, after the kind's own checks (its ``__post_init__`` calls this
    one).
    """

    def __post_init__(self) -> None:
        check_int(self, "header_len", minimum=0)
        for f in fields(self):
            if "length" in f.metadata:
                check_length(self, f.name, **f.metadata["length"])


def sample_len(dist: LengthDist | int, rng: np.random.Generator) -> int:
    """One length (0 for a field left at 0)."""
    if isinstance(dist, int):
        return dist
    return int(dist.sample(1, rng)[0])


def sample_lens(dist: LengthDist, n: int, rng: np.random.Generator) -> list[int]:
    return dist.sample(n, rng).tolist()
