"""Tenants: who may call the server, under which identity, with which weight and limits.

The tenants file is TOML::

    [defaults]               # optional; applies to every tenant (and unlisted clients)
    weight = 1.0

    [[tenant]]
    name = "acme"
    api_keys = ["sk-acme-1", "sk-acme-2"]
    weight = 2.0             # optional, > 0: share of the GPU under weighted fair policies
    max_inflight = 64        # optional int >= 1: requests in flight at once; more -> 429
    max_input_tokens = 8192  # optional int >= 1: per-request prompt cap
    rpm = 600                # optional > 0: requests per minute (token bucket) -> 429
    burst = 100              # optional >= 1: the bucket's size (default: rpm)
    priority_class = "rt"    # optional "rt" | "be": the class of requests that give none
    allow_rt = false         # optional (default true): real-time requests are refused (403)
    admin = true             # optional: may call the admin endpoints (flush cache, abort any)

Identity decides fairness, so it must not be forgeable: when any tenant has API keys,
every request needs ``Authorization: Bearer KEY`` and its tenant is the key's, whatever
``X-Client-Id``, ``user`` or ``routing_key`` say (:func:`identity_from_headers`).
Without keys the file only names client identities and gives them weights.

Errors are :class:`ConfigError` naming the file, the tenant (index and name) and the
field, because the operator reads them at start-up. Unknown fields are errors: a typo
such as ``wieght`` would otherwise silently leave the default.

This module imports only the standard library (the core's rule).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: no TOML in the standard library
    tomllib = None  # type: ignore[assignment]

from sgl_fair.request import DEFAULT_CLIENT, ServiceClass

PRIORITY_CLASSES = tuple(c.value for c in ServiceClass)

__all__ = [
    "AuthError",
    "BadClientId",
    "ConfigError",
    "RateLimiter",
    "Tenant",
    "TenantDefaults",
    "TenantTable",
    "identity_from_headers",
    "load_tenants",
    "parse_tenants",
    "validate_client_id",
]


class ConfigError(ValueError):
    """The tenants file is missing, not TOML, or says something invalid."""


class AuthError(Exception):
    """No or an unknown API key while keys are configured: the server answers 401."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadClientId(ValueError):
    """A client id that cannot be an identity (empty, too long, whitespace): a 400."""


# ---- client ids -----------------------------------------------------------------------------

MAX_CLIENT_ID_LEN = 128
_NO_SPACE = re.compile(r"\S+")


def validate_client_id(value: str, source: str = "client id") -> str:
    """``value`` if it is 1..128 printable characters without whitespace.

    Ids become metric labels, log fields and dictionary keys for fairness counters: an
    empty or enormous id, or one with control characters, would corrupt those.
    """
    if (
        not isinstance(value, str)
        or not 1 <= len(value) <= MAX_CLIENT_ID_LEN
        or not value.isprintable()
        or not _NO_SPACE.fullmatch(value)
    ):
        raise BadClientId(
            f"{source} must be 1..{MAX_CLIENT_ID_LEN} printable characters without "
            f"whitespace (got {value!r:.80})"
        )
    return value


# ---- tenants --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TenantDefaults:
    """The ``[defaults]`` table: values for tenants that do not set them and for clients
    that are not listed (possible only without API keys)."""

    weight: float = 1.0
    max_inflight: int | None = None
    max_input_tokens: int | None = None
    rpm: float | None = None
    burst: float | None = None
    priority_class: str | None = None  # "rt" | "be"; None: BE
    allow_rt: bool = True  # False: this tenant's real-time requests get 403


@dataclass(frozen=True)
class Tenant:
    """One tenant. ``api_keys`` are kept only as SHA-256 digests inside :class:`TenantTable`;
    here they are the configured strings (the table needs them once, to index)."""

    name: str
    api_keys: tuple[str, ...] = ()
    weight: float = 1.0
    max_inflight: int | None = None
    max_input_tokens: int | None = None
    rpm: float | None = None
    burst: float | None = None
    admin: bool = False
    # The service class (BROS's "rt" / "be") of this tenant's requests that do not name one
    # (``priority_class`` field or ``X-Priority-Class`` header); None: BE.
    priority_class: str | None = None
    # May this tenant ask for real-time service? RT requests jump BE work (BROS), so an
    # operator can keep a tenant to best-effort; its RT requests then get 403.
    allow_rt: bool = True

    def make_limiter(self, now: float) -> RateLimiter | None:
        """A fresh token bucket for ``rpm`` (None without a rate limit)."""
        if self.rpm is None:
            return None
        return RateLimiter(self.rpm, self.burst, now)

    def __repr__(self) -> str:  # never print keys into logs
        keys = f"<{len(self.api_keys)} keys>"
        return (
            f"Tenant(name={self.name!r}, api_keys={keys}, weight={self.weight:g}, "
            f"max_inflight={self.max_inflight}, max_input_tokens={self.max_input_tokens}, "
            f"rpm={self.rpm}, burst={self.burst}, admin={self.admin}, "
            f"priority_class={self.priority_class}, allow_rt={self.allow_rt})"
        )


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class TenantTable:
    """The tenants, indexed by name and by API key.

    Key lookup: the table maps SHA-256(key) to the tenant. A presented key is hashed and
    looked up in a dict, then confirmed with ``hmac.compare_digest``. Why this is safe
    against timing attacks: the time a dict lookup takes depends on the presented key's
    digest, which an attacker cannot steer toward a real key's digest without knowing
    the key (SHA-256 preimages), so response times leak nothing about how many leading
    characters of a real key were guessed right, unlike ``presented == stored`` on the
    raw strings. The plaintext keys are not kept in the index.
    """

    def __init__(
        self,
        tenants: Iterable[Tenant],
        defaults: TenantDefaults | None = None,
        source: str = "<tenants>",
    ) -> None:
        self.tenants: tuple[Tenant, ...] = tuple(tenants)
        self.defaults = defaults or TenantDefaults()
        self.source = source
        self._by_name: dict[str, Tenant] = {}
        self._by_digest: dict[bytes, Tenant] = {}
        for i, t in enumerate(self.tenants):
            where = f"{source}: tenant[{i}] ({t.name!r})"
            if t.name in self._by_name:
                raise ConfigError(f"{where}: duplicate tenant name {t.name!r}")
            self._by_name[t.name] = t
            for key in t.api_keys:
                d = _digest(key)
                other = self._by_digest.get(d)
                if other is not None:
                    whose = "this tenant" if other is t else f"tenant {other.name!r}"
                    raise ConfigError(f"{where}: api_keys: a key is also used by {whose}")
                self._by_digest[d] = t
        self.requires_auth: bool = bool(self._by_digest)
        if self.requires_auth:
            for i, t in enumerate(self.tenants):
                if not t.api_keys:
                    raise ConfigError(
                        f"{source}: tenant[{i}] ({t.name!r}): api_keys is required when any "
                        "tenant has keys (a keyless tenant could not be reached)"
                    )

    def by_key(self, key: str) -> Tenant | None:
        """The tenant owning ``key``, or None."""
        d = _digest(key)
        tenant = self._by_digest.get(d)
        if tenant is None:
            return None
        # The dict matched on the digest; confirm in constant time (defence in depth).
        for k in tenant.api_keys:
            if hmac.compare_digest(_digest(k), d):
                return tenant
        return None  # pragma: no cover - unreachable: the index is built from api_keys

    def get(self, name: str) -> Tenant | None:
        """The listed tenant called ``name``, or None."""
        return self._by_name.get(name)

    def effective(self, name: str) -> Tenant:
        """The listed tenant, or a tenant with the ``[defaults]`` for an unlisted client."""
        tenant = self._by_name.get(name)
        if tenant is not None:
            return tenant
        d = self.defaults
        return Tenant(
            name, (), d.weight, d.max_inflight, d.max_input_tokens, d.rpm, d.burst,
            priority_class=d.priority_class, allow_rt=d.allow_rt,
        )  # fmt: skip

    @property
    def weights(self) -> dict[str, float]:
        """Tenant name -> weight, for the weighted fair policies (unlisted: defaults.weight)."""
        return {t.name: t.weight for t in self.tenants}

    def __len__(self) -> int:
        return len(self.tenants)

    def __repr__(self) -> str:
        return f"TenantTable({len(self.tenants)} tenants from {self.source!r})"


# ---- loading --------------------------------------------------------------------------------

_LIMIT_FIELDS = {f.name for f in fields(TenantDefaults)}
_TENANT_FIELDS = {"name", "api_keys", "admin"} | _LIMIT_FIELDS


def _is_number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _check_limits(table: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Validate the limit fields of a ``[defaults]`` or ``[[tenant]]`` table."""
    out: dict[str, Any] = {}
    for key, v in table.items():
        if key == "weight":
            if not _is_number(v) or v <= 0:
                raise ConfigError(f"{where}: weight must be a number > 0 (got {v!r})")
            out[key] = float(v)
        elif key in ("max_inflight", "max_input_tokens"):
            if type(v) is not int or v < 1:
                raise ConfigError(f"{where}: {key} must be an integer >= 1 (got {v!r})")
            out[key] = v
        elif key == "rpm":
            if not _is_number(v) or v <= 0:
                raise ConfigError(f"{where}: rpm must be a number > 0 (got {v!r})")
            out[key] = float(v)
        elif key == "burst":
            if not _is_number(v) or v < 1:
                raise ConfigError(f"{where}: burst must be a number >= 1 (got {v!r})")
            out[key] = float(v)
        elif key == "priority_class":
            if v not in PRIORITY_CLASSES:
                raise ConfigError(f'{where}: priority_class must be "rt" or "be" (got {v!r})')
            out[key] = v
        elif key == "allow_rt":
            if type(v) is not bool:
                raise ConfigError(f"{where}: allow_rt must be true or false (got {v!r})")
            out[key] = v
    if out.get("priority_class") == "rt" and out.get("allow_rt") is False:
        raise ConfigError(f'{where}: priority_class = "rt" contradicts allow_rt = false')
    return out


def _unknown(table: Mapping[str, Any], allowed: set[str], where: str) -> None:
    for key in table:
        if key not in allowed:
            known = ", ".join(sorted(allowed))
            raise ConfigError(f"{where}: unknown field {key!r} (known: {known})")


def parse_tenants(data: Mapping[str, Any], source: str = "<tenants>") -> TenantTable:
    """A :class:`TenantTable` from the parsed TOML document (what :func:`load_tenants` reads)."""
    _unknown(data, {"defaults", "tenant"}, source)
    raw_defaults = data.get("defaults", {})
    if not isinstance(raw_defaults, dict):
        raise ConfigError(f"{source}: [defaults] must be a table")
    _unknown(raw_defaults, _LIMIT_FIELDS, f"{source}: [defaults]")
    defaults = TenantDefaults(**_check_limits(raw_defaults, f"{source}: [defaults]"))

    raw_tenants = data.get("tenant", [])
    if not isinstance(raw_tenants, list) or not all(isinstance(t, dict) for t in raw_tenants):
        raise ConfigError(f"{source}: tenant must be an array of tables ([[tenant]])")
    tenants = []
    for i, raw in enumerate(raw_tenants):
        name = raw.get("name")
        where = f"{source}: tenant[{i}]"
        if name is None:
            raise ConfigError(f"{where}: name is required")
        if not isinstance(name, str):
            raise ConfigError(f"{where}: name must be a string (got {name!r})")
        try:
            validate_client_id(name, "name")
        except BadClientId as e:
            raise ConfigError(f"{where}: {e}") from None
        where = f"{source}: tenant[{i}] ({name!r})"
        _unknown(raw, _TENANT_FIELDS, where)
        keys = raw.get("api_keys", [])
        if not isinstance(keys, list):
            raise ConfigError(f"{where}: api_keys must be a list of strings")
        for j, key in enumerate(keys):
            if not isinstance(key, str):
                raise ConfigError(f"{where}: api_keys[{j}] must be a string")
            if not key:
                raise ConfigError(f"{where}: api_keys[{j}] is empty")
            if not _NO_SPACE.fullmatch(key) or not key.isprintable():
                raise ConfigError(
                    f"{where}: api_keys[{j}] must be printable without whitespace "
                    "(it travels in an Authorization header)"
                )
        admin = raw.get("admin", False)
        if type(admin) is not bool:
            raise ConfigError(f"{where}: admin must be true or false (got {admin!r})")
        limits = {f: getattr(defaults, f) for f in _LIMIT_FIELDS}
        limits.update(_check_limits(raw, where))
        if limits["burst"] is not None and limits["rpm"] is None:
            raise ConfigError(f"{where}: burst needs rpm (it is the rpm bucket's size)")
        tenants.append(Tenant(name=name, api_keys=tuple(keys), admin=admin, **limits))
    return TenantTable(tenants, defaults, source)


def load_tenants(path: str | Path) -> TenantTable:
    """Read and validate a tenants file (TOML); :class:`ConfigError` on any problem."""
    source = str(path)
    if tomllib is None:
        raise ConfigError(f"{source}: reading TOML needs Python >= 3.11 (tomllib)")
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{source}: file not found") from None
    except OSError as e:
        raise ConfigError(f"{source}: cannot read: {e.strerror or e}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: invalid TOML: {e}") from None
    return parse_tenants(data, source)


# ---- identity -------------------------------------------------------------------------------


def identity_from_headers(
    table: TenantTable | None,
    headers: Mapping[str, str],
    body_user: str | None = None,
    routing_key: str | None = None,
) -> tuple[str, Tenant | None]:
    """``(client id, tenant or None)`` of a request; ``headers`` have lower-case names.

    * Keys configured (``table.requires_auth``): ``Authorization: Bearer KEY`` is
      required (:class:`AuthError` "missing API key" / "invalid API key") and the tenant
      is the key's alone: ``X-Client-Id``, ``user`` and ``routing_key`` are ignored for
      identity, so a keyed tenant cannot pass for another.
    * Otherwise the first of the ``X-Client-Id`` header, OpenAI's ``user`` field and
      ``routing_key``, else ``"default"``; it is validated (:class:`BadClientId`), and
      the tenant is the listed one of that name (None if unlisted; see
      :meth:`TenantTable.effective` for its limits).
    """
    if table is not None and table.requires_auth:
        auth = headers.get("authorization")
        if not auth:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = auth.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        tenant = table.by_key(key)
        if tenant is None:
            raise AuthError("invalid API key")
        return tenant.name, tenant
    for value, source in (
        (headers.get("x-client-id"), "X-Client-Id header"),
        (body_user, "user"),
        (routing_key, "routing_key"),
    ):
        if value is not None:
            client = validate_client_id(value, source)
            return client, table.get(client) if table is not None else None
    return DEFAULT_CLIENT, table.get(DEFAULT_CLIENT) if table is not None else None


# ---- rate limiting --------------------------------------------------------------------------


class RateLimiter:
    """A token bucket for ``rpm`` requests per minute, holding at most ``burst`` (default
    ``rpm``: a minute's allowance) saved-up requests.

    Over any interval of ``T`` seconds it admits at most ``burst + rpm * T / 60``
    requests, and never refuses a client that stays under its rate. Pure: the caller
    passes the clock (``now`` in seconds, any origin, monotonic); a clock that steps
    back is treated as no time passing. A new bucket starts full.
    """

    __slots__ = ("rpm", "rate_per_s", "burst", "_tokens", "_last")

    def __init__(self, rpm: float, burst: float | None = None, now: float = 0.0) -> None:
        if not rpm > 0 or not math.isfinite(rpm):
            raise ValueError(f"rpm must be > 0 (got {rpm})")
        burst = rpm if burst is None else burst
        if not burst >= 1 or not math.isfinite(burst):
            raise ValueError(f"burst must be >= 1 (got {burst})")
        self.rpm = float(rpm)
        self.rate_per_s = self.rpm / 60.0
        self.burst = float(burst)
        self._tokens = self.burst
        self._last = now

    def _refill(self, now: float) -> None:
        if now > self._last:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate_per_s)
            self._last = now

    def try_acquire(self, now: float, cost: float = 1.0) -> float | None:
        """None if admitted (and charged), else the seconds to wait before retrying
        (for ``Retry-After``); a refused request is not charged."""
        self._refill(now)
        if self._tokens >= cost:
            self._tokens -= cost
            return None
        return (cost - self._tokens) / self.rate_per_s

    def available(self, now: float) -> float:
        self._refill(now)
        return self._tokens
