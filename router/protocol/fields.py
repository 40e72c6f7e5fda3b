"""The field checks every request parser shares: one value against its type and range, each
failure a :class:`ProtocolError` naming the field's JSON path (``sampling_params.top_p must be
a number in (0, 1] (got 2)``), because the person reading the 400 is debugging a client.

``check_*(value, path, ...)`` return the value checked (or raise); ``v_*`` are the same checks
as table validators, ``(value, path, limits) -> value``, for a :data:`FieldTable` (wire key ->
``(SamplingParams field or None, validator)``, or a :class:`PassThrough`: a key only a real
engine honours). ``is_empty``: ``null``, ``false``, ``""``, ``[]`` and ``{}`` all mean "not
given" (SGLang's own frontend sends ``"regex": null`` with every request).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from sgl_fair.router.protocol.errors import ProtocolError

if TYPE_CHECKING:
    from sgl_fair.router.protocol.requests_common import Limits

# ---- one value ---------------------------------------------------------------------------


def show(value: Any) -> str:
    try:
        text = msgspec.json.encode(value).decode()
    except (TypeError, msgspec.EncodeError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def bad_value(path: str, what: str, value: Any) -> ProtocolError:
    return ProtocolError(400, f"{path} must be {what} (got {show(value)})", path)


def unsupported(path: str, what: str | None = None) -> ProtocolError:
    return ProtocolError(400, f"{what or path} is not supported by this server", path)


def is_int(v: Any) -> bool:
    return type(v) is int  # bool is an int subclass, and true is not a token count


def is_num(v: Any) -> bool:
    return (type(v) is int or type(v) is float) and math.isfinite(v)


def range_text(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    return f"<= {hi:g}"


def check_int(v: Any, path: str, lo: int | None = None, hi: int | None = None) -> int:
    if not is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        what = "an integer" if lo is None and hi is None else f"an integer {range_text(lo, hi)}"
        raise bad_value(path, what, v)
    return v


def check_num(
    v: Any, path: str, lo: float, hi: float | None = None, lo_open: bool = False
) -> float:
    ok = is_num(v) and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
    if not ok:
        raise bad_value(path, f"a number {range_text(lo, hi, lo_open)}", v)
    return float(v)


def check_bool(v: Any, path: str) -> bool:
    if type(v) is not bool:
        raise bad_value(path, "a boolean", v)
    return v


def check_str(v: Any, path: str, *, nonempty: bool = False) -> str:
    if type(v) is not str or (nonempty and not v):
        raise bad_value(path, "a non-empty string" if nonempty else "a string", v)
    return v


def check_obj(v: Any, path: str) -> dict[str, Any]:
    if type(v) is not dict:
        raise bad_value(path, "an object", v)
    return v


def is_empty(v: Any) -> bool:
    """``null``, ``false``, ``""``, ``[]`` and ``{}`` all mean "not used"."""
    return v is None or v is False or (isinstance(v, (str, list, dict)) and not v)


def load_object(body: bytes) -> dict[str, Any]:
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise ProtocolError(400, f"request body is not valid JSON: {e}") from None
    if type(obj) is not dict:
        raise ProtocolError(400, f"request body must be a JSON object (got {show(obj)})")
    return obj


def check_int_list(v: Any, path: str) -> list[int]:
    """A list of token ids (ints >= 0); the per-element loop runs only to name a bad one."""
    if type(v) is not list:
        raise bad_value(path, "a list of token ids", v)
    if v and (set(map(type, v)) != {int} or min(v) < 0):
        for i, x in enumerate(v):
            check_int(x, f"{path}[{i}]", lo=0)
    return v


def check_stop(v: Any, path: str, limits: Limits) -> tuple[str, ...]:
    stops = [v] if type(v) is str else v
    if type(stops) is not list:
        raise bad_value(path, "a string or a list of strings", v)
    if len(stops) > limits.max_stop:
        raise ProtocolError(
            400, f"{path} has {len(stops)} entries; at most {limits.max_stop} are allowed", path
        )
    for i, s in enumerate(stops):
        check_str(s, path if type(v) is str else f"{path}[{i}]", nonempty=True)
    return tuple(stops)


# ---- table validators: (value, path, limits) -> value ----------------------------------------


def v_max_new(v: Any, path: str, limits: Limits) -> int:
    n = check_int(v, path, lo=0)
    if n > limits.new_tokens_cap:
        raise ProtocolError(400, f"{path} must be <= {limits.new_tokens_cap} (got {n})", path)
    return n


def v_top_k(v: Any, path: str, limits: Limits) -> int:
    if not is_int(v) or (v < 1 and v not in (-1, 0)):
        raise bad_value(path, "-1 or 0 (disabled) or an integer >= 1", v)
    return -1 if v == 0 else v


def v_n(v: Any, path: str, limits: Limits) -> int:
    return check_int(v, path, 1, limits.max_n)


def v_null_only(v: Any, path: str, limits: Limits) -> None:
    if not is_empty(v):
        raise unsupported(path)


@dataclass(frozen=True)
class PassThrough:
    """A key passed through untouched to an engine with ``EngineFeatures.passthrough``,
    refused on the others with ``why`` when it is set; ``check`` validates its value first."""

    why: str
    check: Any = None


def v_any(v: Any, path: str, limits: Limits) -> Any:
    return v


def v_str(v: Any, path: str, limits: Limits) -> str:
    return check_str(v, path)


def v_obj(v: Any, path: str, limits: Limits) -> dict[str, Any]:
    return check_obj(v, path)


def v_str_or_list(v: Any, path: str, limits: Limits) -> Any:
    if type(v) is str:
        return v
    if type(v) is not list or any(type(x) is not str for x in v):
        raise bad_value(path, "a string or a list of strings", v)
    return v


def v_str_list(v: Any, path: str, limits: Limits) -> list[str]:
    if type(v) is not list or any(type(x) is not str for x in v):
        raise bad_value(path, "a list of strings", v)
    return v


def v_str_or_obj(v: Any, path: str, limits: Limits) -> Any:
    if type(v) not in (str, dict):
        raise bad_value(path, "a string or an object", v)
    return v


def v_stream_interval(v: Any, path: str, limits: Limits) -> int:
    return check_int(v, path, lo=1)


def v_num(lo: float, hi: float | None, lo_open: bool = False):
    return lambda v, path, limits: check_num(v, path, lo, hi, lo_open)


def v_int(lo: int | None = None, hi: int | None = None):
    return lambda v, path, limits: check_int(v, path, lo, hi)


def v_bool(v: Any, path: str, limits: Limits) -> bool:
    return check_bool(v, path)


def v_stop(v: Any, path: str, limits: Limits) -> tuple[str, ...]:
    return check_stop(v, path, limits)


def v_ids(v: Any, path: str, limits: Limits) -> tuple[int, ...]:
    return tuple(check_int_list(v, path))


# wire key -> (SamplingParams field or None to drop, validator(value, path, limits)),
# or a PassThrough: passed through to an engine that takes it, refused on the others.
FieldTable = dict[str, Any]
