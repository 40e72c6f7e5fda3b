"""Scheduling fields of a generation request: the service class (BROS's RT / BE) with its
SLOs, and the interaction a call belongs to (FairServe's ``interaction_id``, ``app``,
``stage``, and ``system_len``: the prompt's system-prompt tokens, FairServe's ``L_S``).

Where each comes from, first found wins (``docs/fairserve.md``):

* class: the body's ``priority_class`` (``"rt"`` / ``"be"``), else the
  ``X-Priority-Class`` header, else SGLang's integer ``priority`` when the server was
  started with ``--rt-priority-threshold N`` (``priority >= N`` is RT; ``<= N`` with
  ``--schedule-low-priority-values-first``), else the tenant's ``priority_class``
  (tenants file, or its ``[defaults]``), else BE;
* SLOs: the body's ``ttft_slo_s`` / ``tpot_slo_s`` (seconds, > 0), else the defaults;
* interaction: the body's ``interaction_id`` / ``app`` / ``stage``, else the
  ``X-Interaction-Id`` / ``X-App`` / ``X-Stage`` headers. With API keys the interaction id
  is namespaced by the authenticated tenant (``"tenant/id"``), so a caller can neither
  join nor claim another tenant's interaction;
* ``system_len``: the body's, else the ``X-System-Len`` header (a declared system-prefix
  length); a chat request without one counts its system messages' tokens (the OpenAI
  route); none: the worker uses the app's configured length.

:func:`parse_hints` reads the body fields (a 400 naming the field); :func:`resolve`
merges the headers (a 400 naming the header), the priority mapping and the tenant's
default into the :class:`Scheduling` a ``Request`` is built with. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sgl_fair.request import (
    DEFAULT_TPOT_SLO_S,
    DEFAULT_TTFT_SLO_S,
    MAX_SLO_S,
    ServiceClass,
    valid_slo,
)
from sgl_fair.router.protocol.errors import ProtocolError
from sgl_fair.router.protocol.fields import (
    bad_value,
    check_int,
    range_text,
)

PRIORITY_CLASSES = tuple(c.value for c in ServiceClass)  # ("rt", "be")
MAX_INTERACTION_ID_LEN = 256
MAX_APP_LEN = 128
MAX_STAGE = 100_000
MAX_SYSTEM_LEN = 10_000_000

# body field -> header (lower-case) giving the same value
HEADERS = {
    "priority_class": "x-priority-class",
    "interaction_id": "x-interaction-id",
    "app": "x-app",
    "stage": "x-stage",
    "system_len": "x-system-len",
}
# how each header is spelled in messages
_HEADER_NAMES = {
    "x-priority-class": "X-Priority-Class",
    "x-interaction-id": "X-Interaction-Id",
    "x-app": "X-App",
    "x-stage": "X-Stage",
    "x-system-len": "X-System-Len",
}
SCHEDULING_FIELDS = frozenset(
    {"priority_class", "ttft_slo_s", "tpot_slo_s", "interaction_id", "app", "stage", "system_len"}
)


@dataclass(frozen=True, slots=True)
class Hints:
    """What a request body said (None: not given)."""

    priority_class: str | None = None
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    interaction_id: str | None = None
    app: str | None = None
    stage: int | None = None
    system_len: int | None = None
    priority: int | None = None  # SGLang's own field


@dataclass(frozen=True, slots=True)
class Scheduling:
    """What the ``Request`` is built with."""

    service_class: ServiceClass = ServiceClass.BE
    ttft_slo_s: float = DEFAULT_TTFT_SLO_S
    tpot_slo_s: float = DEFAULT_TPOT_SLO_S
    interaction_id: str | None = None
    app: str | None = None
    stage: int = 0
    system_len: int | None = None

    @property
    def priority_class(self) -> str:
        return _CLASS_NAME[self.service_class]  # (an Enum's .value is slow: every event reads it)


_CLASS_NAME = {c: c.value for c in ServiceClass}


def _class(v: Any, path: str) -> str:
    if type(v) is not str or v.lower() not in PRIORITY_CLASSES:
        raise bad_value(path, '"rt" or "be"', v)
    return v.lower()


def _label(v: Any, path: str, max_len: int) -> str:
    """A non-empty printable string of at most ``max_len`` characters."""
    if type(v) is not str or not 1 <= len(v) <= max_len or not v.isprintable():
        raise bad_value(path, f"a non-empty printable string of at most {max_len} characters", v)
    return v


def check_slo(v: Any, path: str) -> float:
    if not valid_slo(v):  # the core's contract, shared with the SGLang plugin
        raise bad_value(path, f"a number {range_text(0.0, MAX_SLO_S, lo_open=True)}", v)
    return float(v)


_CHECKS = {
    "priority_class": _class,
    "ttft_slo_s": check_slo,
    "tpot_slo_s": check_slo,
    "interaction_id": lambda v, p: _label(v, p, MAX_INTERACTION_ID_LEN),
    "app": lambda v, p: _label(v, p, MAX_APP_LEN),
    "stage": lambda v, p: check_int(v, p, 0, MAX_STAGE),
    "system_len": lambda v, p: check_int(v, p, 0, MAX_SYSTEM_LEN),
}


def parse_hints(obj: Mapping[str, Any]) -> Hints | None:
    """The scheduling fields of a request body (top level; None when it gives none);
    ``null`` means not given. A bad value is a 400 naming the field. SGLang's ``priority``
    must be an integer."""
    values: dict[str, Any] = {}
    for key, check in _CHECKS.items():
        v = obj.get(key)
        if v is not None:
            values[key] = check(v, key)
    priority = obj.get("priority")
    if priority is not None:
        values["priority"] = check_int(priority, "priority")
    return Hints(**values) if values else None


def _from_header(headers: Mapping[str, str], key: str) -> Any:
    name = HEADERS[key]
    raw = headers.get(name)
    if raw is None:
        return None
    shown = _HEADER_NAMES[name]
    raw = raw.strip()
    try:
        if key in ("stage", "system_len"):
            top = MAX_STAGE if key == "stage" else MAX_SYSTEM_LEN
            if not re.fullmatch(r"[0-9]{1,8}", raw):
                raise bad_value(f"{shown} header", f"an integer in [0, {top}]", raw)
            return check_int(int(raw), f"{shown} header", 0, top)
        return _CHECKS[key](raw, f"{shown} header")
    except ProtocolError as e:
        e.param = shown  # the header's name, as a body field's error names the field
        raise


def resolve(
    hints: Hints,
    headers: Mapping[str, str],
    *,
    tenant_class: str | None = None,
    namespace: str | None = None,
    rt_priority_threshold: int | None = None,
    low_priority_values_first: bool = False,
) -> Scheduling:
    """The request's :class:`Scheduling` (see the module docstring for the order).

    ``headers`` have lower-case names. ``tenant_class``: the tenant's default class (None:
    BE). ``namespace``: the authenticated tenant when API keys are on (the interaction id
    becomes ``f"{namespace}/{id}"``). ``rt_priority_threshold``: SGLang's ``priority`` sets
    the class only when this is given.
    """
    cls = hints.priority_class or _from_header(headers, "priority_class")
    if cls is None and hints.priority is not None and rt_priority_threshold is not None:
        if low_priority_values_first:
            rt = hints.priority <= rt_priority_threshold
        else:
            rt = hints.priority >= rt_priority_threshold
        cls = "rt" if rt else "be"
    if cls is None:
        cls = tenant_class or "be"
    iid = hints.interaction_id
    if iid is None:
        iid = _from_header(headers, "interaction_id")
    if iid is not None and namespace is not None:
        iid = f"{namespace}/{iid}"
    app = hints.app if hints.app is not None else _from_header(headers, "app")
    stage = hints.stage if hints.stage is not None else _from_header(headers, "stage")
    system_len = hints.system_len
    if system_len is None:
        system_len = _from_header(headers, "system_len")
    return Scheduling(
        service_class=ServiceClass(cls),
        ttft_slo_s=DEFAULT_TTFT_SLO_S if hints.ttft_slo_s is None else hints.ttft_slo_s,
        tpot_slo_s=DEFAULT_TPOT_SLO_S if hints.tpot_slo_s is None else hints.tpot_slo_s,
        interaction_id=iid,
        app=app,
        stage=0 if stage is None else stage,
        system_len=system_len,
    )


# ---- FairServe's throttling, as the worker reports it ----------------------------------------


@dataclass(frozen=True, slots=True)
class Throttle:
    """A request FairServe's OIT refused: which limit (``"user"`` or ``"app"``), its size
    in requests per ``window_s`` (the worker's ``Finished.limit``)."""

    limit: str
    max_requests: int
    window_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"limit": self.limit, "max_requests": self.max_requests, "window_s": self.window_s}


def throttle_of(limit: tuple[str, int, float] | None) -> Throttle | None:
    """The :class:`Throttle` a worker's ``Finished.limit`` names (None: not a windowed limit)."""
    if limit is None:
        return None
    name, max_requests, window_s = limit
    return Throttle(str(name), int(max_requests), float(window_s))
