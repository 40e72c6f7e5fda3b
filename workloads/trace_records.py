"""Trace records: one request of a JSONL trace, by lengths, and the parser that checks them.

``TraceRecord`` validates its fields on construction (each error names the field);
``parse_trace_records`` reads JSONL lines into records sorted by arrival with every ``rid``
filled in, raising ``TraceError`` with ``source:line: what is wrong``. ``traces.py`` turns
records into requests and re-exports these names.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any


class TraceError(ValueError):
    """A malformed trace; the message is one line: ``source:line: what is wrong``."""


class _FieldError(ValueError):
    """One field of a record is wrong; the message names it."""


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _need_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _FieldError(f"field {name!r} must be an integer >= {minimum} (got {_show(value)})")


def _need_number(name: str, value: Any, *, positive: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise _FieldError(f"field {name!r} must be a number {bound} (got {_show(value)})")


def _need_str(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise _FieldError(f"field {name!r} must be a non-empty string (got {_show(value)})")


@dataclass(frozen=True)
class TraceRecord:
    """One request of a trace, by lengths. Field names are the JSONL keys.

    ``prefix_len`` defaults to ``input_len // 2`` when ``prefix_group`` is set; ``rid``
    defaults (in :func:`to_requests`) to ``f"{client}-{i}"``, i counting the client's
    requests in arrival order; ``None`` SLOs mean the :class:`Request` defaults.
    """

    arrival_s: float
    client: str
    input_len: int
    output_len: int
    prefix_group: str | None = None
    prefix_len: int | None = None
    max_new_tokens: int | None = None
    rid: str | None = None
    service_class: str = "be"
    interaction_id: str | None = None
    app: str | None = None
    stage: int = 0
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None

    def __post_init__(self) -> None:
        _need_number("arrival_s", self.arrival_s)
        _need_str("client", self.client)
        _need_int("input_len", self.input_len, 1)
        _need_int("output_len", self.output_len, 1)
        for name in ("prefix_group", "rid", "interaction_id", "app"):
            if getattr(self, name) is not None:
                _need_str(name, getattr(self, name))
        if self.service_class not in ("rt", "be"):
            raise _FieldError(
                f'field \'service_class\' must be "rt" or "be" (got {_show(self.service_class)})'
            )
        _need_int("stage", self.stage, 0)
        for name in ("ttft_slo_s", "tpot_slo_s"):
            if getattr(self, name) is not None:
                _need_number(name, getattr(self, name), positive=True)
        if self.max_new_tokens is not None:
            _need_int("max_new_tokens", self.max_new_tokens, self.output_len)
        if self.prefix_len is not None:
            if self.prefix_group is None:
                raise _FieldError("field 'prefix_len' is set but 'prefix_group' is not")
            _need_int("prefix_len", self.prefix_len, 0)
            if self.prefix_len > self.input_len:
                raise _FieldError(
                    f"field 'prefix_len' must be <= input_len {self.input_len} "
                    f"(got {self.prefix_len})"
                )
        elif self.prefix_group is not None:
            object.__setattr__(self, "prefix_len", self.input_len // 2)

    def to_json_dict(self) -> dict[str, Any]:
        """The JSONL object: required fields, then the optional ones that are not defaults."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _REQUIRED or value != f.default:
                out[f.name] = value
        return out


_REQUIRED = ("arrival_s", "client", "input_len", "output_len")
_KNOWN = tuple(f.name for f in fields(TraceRecord))


def _record_from_json(obj: Any) -> TraceRecord:
    if not isinstance(obj, dict):
        raise _FieldError(f"expected a JSON object, got {type(obj).__name__}")
    for key in obj:
        if key not in _KNOWN:
            raise _FieldError(f"unknown field {key!r} (known: {', '.join(_KNOWN)})")
    for key in _REQUIRED:
        if key not in obj:
            raise _FieldError(f"missing required field {key!r}")
    # null in an optional field means "absent"; in a required one it fails the type check.
    return TraceRecord(**{k: v for k, v in obj.items() if v is not None or k in _REQUIRED})


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _FieldError(f"field {key!r} appears twice")
        out[key] = value
    return out


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicate_keys)


def _default_rids(records: Sequence[TraceRecord]) -> list[str]:
    """Each record's rid: its own, else ``f"{client}-{i}"`` (i-th of its client, in order)."""
    counts: dict[str, int] = {}
    rids = []
    for rec in records:
        i = counts.get(rec.client, 0)
        counts[rec.client] = i + 1
        rids.append(rec.rid if rec.rid is not None else f"{rec.client}-{i}")
    return rids


def parse_trace_records(lines: Iterable[str], *, source: str = "<trace>") -> list[TraceRecord]:
    """Parse JSONL lines into records sorted by arrival (stably), every ``rid`` filled in.

    Blank lines and lines starting with ``#`` are skipped. Any error raises
    :class:`TraceError` naming ``source``, the line number and the field.
    """
    parsed: list[tuple[TraceRecord, int]] = []
    explicit_rids: dict[str, int] = {}
    for lineno, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            rec = _record_from_json(_DECODER.decode(line))
        except json.JSONDecodeError as e:
            raise TraceError(
                f"{source}:{lineno}: invalid JSON ({e.msg}, column {e.colno})"
            ) from None
        except _FieldError as e:
            raise TraceError(f"{source}:{lineno}: {e}") from None
        if rec.rid is not None:
            if rec.rid in explicit_rids:
                raise TraceError(
                    f"{source}:{lineno}: field 'rid' {_show(rec.rid)} "
                    f"duplicates line {explicit_rids[rec.rid]}"
                )
            explicit_rids[rec.rid] = lineno
        parsed.append((rec, lineno))
    if not parsed:
        raise TraceError(f"{source}: no requests (the trace is empty)")

    parsed.sort(key=lambda item: item[0].arrival_s)  # stable: ties keep file order
    records = []
    for (rec, lineno), rid in zip(parsed, _default_rids([r for r, _ in parsed]), strict=True):
        if rec.rid is None:
            if rid in explicit_rids:
                raise TraceError(
                    f"{source}:{lineno}: field 'rid' is missing and its default "
                    f"{_show(rid)} is taken by line {explicit_rids[rid]}"
                )
            rec = _replace_rid(rec, rid)
        records.append(rec)
    return records


def _replace_rid(rec: TraceRecord, rid: str) -> TraceRecord:
    new = copy.copy(rec)  # not dataclasses.replace: the rest is validated already
    object.__setattr__(new, "rid", rid)
    return new
