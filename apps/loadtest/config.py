"""One load test's settings (``LoadTestConfig``), their validation, and the one error the app
reports as a single line (``LoadTestError``). Field names follow the CLI flags, so every
message names the flag to fix."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

PROG = "python -m sgl_fair.loadtest"
NATIVE, FRONTEND = "native", "sglang-frontend"
DRIVERS = (NATIVE, FRONTEND)


class LoadTestError(ValueError):
    """A user mistake or an unusable endpoint: one line, exit status 2."""


@dataclass(frozen=True)
class LoadTestConfig:
    """One load test. Field names follow the CLI flags (errors name the flag).

    ``scenario``: ``"s1"``, ``"s2"`` or ``None`` (``"none"`` is accepted too). ``rate``
    overrides ``BASE_RATE_PER_S × dp × rate_scale`` (giving both is an error). ``dp``
    ``None``: the server's ``dp_size``, else 1. ``api_keys`` (client → key) or
    ``api_key_file`` (TOML or JSON of the same), not both. ``out`` ``None``:
    ``runs/loadtest-<timestamp>``; ``write`` False writes nothing (the results still say
    what would have been written where). ``client_names``: the clients' ids in order
    (default ``c0``, ``c1``, …). ``driver``: ``"native"`` (token-level programs over aiohttp)
    or ``"sglang-frontend"`` (the frontend programs, ``tot``/``judge`` only; ``params`` are
    theirs).
    """

    url: str
    workload: str
    scenario: str | None
    clients: int
    duration_s: float
    rate: float | None = None
    rate_scale: float | None = None
    dp: int | None = None
    seed: int = 0
    api_keys: Mapping[str, str] | None = None
    api_key_file: Path | None = None
    out: Path | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    drain_timeout_s: float | None = None
    call_timeout_s: float = 600.0
    health_timeout_s: float = 5.0
    stream_interval: int | None = None
    run_tag: str = ""
    write: bool = True
    client_names: tuple[str, ...] | None = None
    driver: str = NATIVE


# ---------------------------------------------------------------- validation


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return _is_int(x) or (isinstance(x, float) and math.isfinite(x))


def validate(config: LoadTestConfig) -> LoadTestConfig:
    """Check every field; returns the config with ``scenario="none"`` mapped to None."""
    from sgl_fair.workloads.programs import WORKLOADS

    c = config
    if not isinstance(c.url, str) or not c.url.startswith(("http://", "https://")):
        raise LoadTestError(f"--url must be an http:// or https:// URL (got {c.url!r})")
    if c.workload not in WORKLOADS:
        raise LoadTestError(f"--workload: unknown {c.workload!r} (known: {', '.join(WORKLOADS)})")
    scenario = None if c.scenario in (None, "none") else c.scenario
    if scenario not in (None, "s1", "s2"):
        raise LoadTestError(f"--scenario must be s1, s2 or none (got {c.scenario!r})")
    if c.workload == "chat" and scenario is not None:
        raise LoadTestError(
            "--scenario: workload chat is the Fig. 8 flood (c2, c3 misbehave) and takes none"
        )
    if c.workload == "chat":
        min_clients, why = 4, " for workload chat (c2 and c3 flood)"
    elif scenario is not None:
        min_clients, why = 2, f" with scenario {scenario} (c0 misbehaves, the others do not)"
    else:
        min_clients, why = 1, ""
    if not _is_int(c.clients) or c.clients < min_clients:
        raise LoadTestError(f"--clients must be >= {min_clients}{why} (got {c.clients!r})")
    if c.client_names is not None:
        names = tuple(c.client_names)
        if len(names) != c.clients or len(set(names)) != len(names):
            raise LoadTestError(f"--clients: {c.clients} distinct names needed (got {names!r})")
        from sgl_fair.config import BadClientId, validate_client_id

        for name in names:
            try:
                validate_client_id(name, "--clients")
            except BadClientId as e:
                raise LoadTestError(str(e)) from None
    if c.driver not in DRIVERS:
        raise LoadTestError(f"--driver must be one of {', '.join(DRIVERS)} (got {c.driver!r})")
    if c.driver == FRONTEND and c.workload not in ("tot", "judge"):
        raise LoadTestError(f"--driver {FRONTEND} runs workload tot or judge (got {c.workload})")
    if not _is_num(c.duration_s) or c.duration_s <= 0:
        raise LoadTestError(f"--duration must be a number > 0 seconds (got {c.duration_s!r})")
    if c.rate is not None and (not _is_num(c.rate) or c.rate <= 0):
        raise LoadTestError(f"--rate must be > 0 programs/s per client (got {c.rate!r})")
    if c.rate_scale is not None and (not _is_num(c.rate_scale) or c.rate_scale <= 0):
        raise LoadTestError(f"--rate-scale must be > 0 (got {c.rate_scale!r})")
    if c.rate is not None and c.rate_scale is not None:
        raise LoadTestError("--rate and --rate-scale: give one (--rate sets the rate outright)")
    if c.dp is not None and (not _is_int(c.dp) or c.dp < 1):
        raise LoadTestError(f"--dp must be an integer >= 1 (got {c.dp!r})")
    if not _is_int(c.seed) or c.seed < 0:
        raise LoadTestError(f"--seed must be an integer >= 0 (got {c.seed!r})")
    if c.drain_timeout_s is not None and (not _is_num(c.drain_timeout_s) or c.drain_timeout_s < 0):
        raise LoadTestError(f"--drain-timeout must be >= 0 seconds (got {c.drain_timeout_s!r})")
    if not _is_num(c.call_timeout_s) or c.call_timeout_s <= 0:
        raise LoadTestError(f"--call-timeout must be > 0 seconds (got {c.call_timeout_s!r})")
    si = c.stream_interval
    if si is not None and (not _is_int(si) or si < 1):
        raise LoadTestError(f"--stream-interval must be an integer >= 1 (got {si!r})")
    if c.api_keys is not None and c.api_key_file is not None:
        raise LoadTestError("--api-key-file: give api_keys or api_key_file, not both")
    return config if scenario == c.scenario else replace(config, scenario=scenario)


def load_api_keys(path: Path) -> dict[str, str]:
    """Client id → API key from a JSON object or a TOML table (``c0 = "sk-..."``)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise LoadTestError(f"--api-key-file: cannot read {path}: {e.strerror or e}") from None
    data: Any = None
    if path.suffix.lower() != ".toml":
        with contextlib.suppress(ValueError):
            data = json.loads(text)
    if data is None:
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            raise LoadTestError(f"--api-key-file: {path} is not JSON (TOML needs 3.11+)") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise LoadTestError(f"--api-key-file: {path} is neither JSON nor TOML: {e}") from None
    if not isinstance(data, dict):
        raise LoadTestError(f"--api-key-file: {path} must map client ids to keys")
    for client, key in data.items():
        if not isinstance(key, str) or not key:
            raise LoadTestError(
                f"--api-key-file: the key of client {client!r} must be a non-empty string"
            )
    return dict(data)
