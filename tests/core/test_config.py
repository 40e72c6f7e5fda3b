"""The tenants file: a good file, every error naming file/tenant/field, identity rules
(a keyed tenant cannot pass for another), and the rpm token bucket."""

from __future__ import annotations

import pytest

from sgl_fair.config import (
    AuthError,
    BadClientId,
    ConfigError,
    RateLimiter,
    Tenant,
    TenantTable,
    identity_from_headers,
    load_tenants,
    validate_client_id,
)

GOOD = """
[defaults]
weight = 1.5
max_inflight = 8

[[tenant]]
name = "acme"
api_keys = ["sk-acme-1", "sk-acme-2"]
weight = 2
max_inflight = 64
max_input_tokens = 8192
rpm = 600

[[tenant]]
name = "globex"
api_keys = ["sk-globex"]
rpm = 30
burst = 5
admin = true
"""


def write(tmp_path, text: str, name: str = "tenants.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_good_file(tmp_path):
    table = load_tenants(write(tmp_path, GOOD))
    assert [t.name for t in table.tenants] == ["acme", "globex"]
    acme, globex = table.tenants
    assert acme == Tenant("acme", ("sk-acme-1", "sk-acme-2"), 2.0, 64, 8192, 600.0, None)
    # unset fields come from [defaults]
    assert (globex.weight, globex.max_inflight, globex.max_input_tokens) == (1.5, 8, None)
    assert (globex.rpm, globex.burst, globex.admin, acme.admin) == (30.0, 5.0, True, False)
    assert table.requires_auth and len(table) == 2
    assert table.weights == {"acme": 2.0, "globex": 1.5}
    assert table.by_key("sk-acme-2") is acme and table.by_key("sk-globex") is globex
    assert table.by_key("sk-acme") is None and table.by_key("") is None
    assert table.get("acme") is acme and table.get("nobody") is None
    unlisted = table.effective("nobody")
    assert (unlisted.name, unlisted.weight, unlisted.max_inflight) == ("nobody", 1.5, 8)
    assert "sk-acme" not in repr(acme)  # keys stay out of logs


def test_empty_file_and_keyless_tenants(tmp_path):
    assert len(load_tenants(write(tmp_path, ""))) == 0
    table = load_tenants(write(tmp_path, '[[tenant]]\nname = "a"\n[[tenant]]\nname = "b"\n'))
    assert not table.requires_auth and table.weights == {"a": 1.0, "b": 1.0}


# (file text, expected message fragments) — every message names the file and the field
ERRORS = [
    ("[[tenant]]\nweight = 2\n", ["tenant[0]", "name is required"]),
    ("[[tenant]]\nname = 5\n", ["tenant[0]", "name must be a string"]),
    ('[[tenant]]\nname = ""\n', ["tenant[0]", "name must be 1..128 printable"]),
    ('[[tenant]]\nname = "a b"\n', ["tenant[0]", "without whitespace"]),
    (
        '[[tenant]]\nname = "a"\n[[tenant]]\nname = "a"\n',
        ["tenant[1] ('a')", "duplicate tenant name"],
    ),
    (
        '[[tenant]]\nname = "a"\napi_keys = ["k1"]\n[[tenant]]\nname = "b"\napi_keys = ["k1"]\n',
        ["tenant[1] ('b')", "api_keys", "also used by tenant 'a'"],
    ),
    (
        '[[tenant]]\nname = "a"\napi_keys = ["k1", "k1"]\n',
        ["tenant[0] ('a')", "also used by this tenant"],
    ),
    ('[[tenant]]\nname = "a"\napi_keys = [""]\n', ["tenant[0] ('a')", "api_keys[0] is empty"]),
    ('[[tenant]]\nname = "a"\napi_keys = ["sk 1"]\n', ["api_keys[0]", "without whitespace"]),
    ('[[tenant]]\nname = "a"\napi_keys = "k"\n', ["tenant[0] ('a')", "api_keys must be a list"]),
    ('[[tenant]]\nname = "a"\napi_keys = [1]\n', ["api_keys[0] must be a string"]),
    (
        '[[tenant]]\nname = "a"\nweight = 0\n',
        ["tenant[0] ('a')", "weight must be a number > 0 (got 0)"],
    ),
    ('[[tenant]]\nname = "a"\nweight = -1.5\n', ["weight must be a number > 0"]),
    ('[[tenant]]\nname = "a"\nweight = "2"\n', ["weight must be a number > 0 (got '2')"]),
    ('[[tenant]]\nname = "a"\nweight = true\n', ["weight must be a number"]),
    ('[[tenant]]\nname = "a"\nweight = inf\n', ["weight must be a number"]),
    ('[[tenant]]\nname = "a"\nmax_inflight = 0\n', ["max_inflight must be an integer >= 1"]),
    ('[[tenant]]\nname = "a"\nmax_inflight = 2.0\n', ["max_inflight must be an integer >= 1"]),
    ('[[tenant]]\nname = "a"\nmax_input_tokens = -3\n', ["max_input_tokens must be an integer"]),
    ('[[tenant]]\nname = "a"\nrpm = 0\n', ["rpm must be a number > 0"]),
    ('[[tenant]]\nname = "a"\nburst = 3\n', ["burst needs rpm"]),
    ('[[tenant]]\nname = "a"\nrpm = 5\nburst = 0.5\n', ["burst must be a number >= 1"]),
    ('[[tenant]]\nname = "a"\nadmin = 1\n', ["tenant[0] ('a')", "admin must be true or false"]),
    ('[[tenant]]\nname = "a"\nwieght = 2\n', ["tenant[0] ('a')", "unknown field 'wieght'"]),
    ("[defaults]\nmax_infligt = 3\n", ["[defaults]", "unknown field 'max_infligt'"]),
    ("[defaults]\nweight = -1\n", ["[defaults]", "weight must be a number > 0"]),
    ("[defaults]\nname = 'x'\n", ["[defaults]", "unknown field 'name'"]),
    ("defaults = 3\n", ["[defaults] must be a table"]),
    ("[tenants]\nname = 'x'\n", ["unknown field 'tenants'"]),
    ("[tenant]\nname = 'x'\n", ["array of tables ([[tenant]])"]),
    (
        '[[tenant]]\nname = "a"\napi_keys = ["k"]\n[[tenant]]\nname = "b"\n',
        ["tenant[1] ('b')", "api_keys is required when any tenant has keys"],
    ),
]


@pytest.mark.parametrize(("text", "fragments"), ERRORS)
def test_errors_name_file_tenant_and_field(tmp_path, text, fragments):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_tenants(path)
    message = str(e.value)
    assert message.startswith(f"{path}: "), message
    for fragment in fragments:
        assert fragment in message, message
    assert isinstance(e.value, ValueError)


def test_file_level_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.toml: file not found"):
        load_tenants(tmp_path / "nope.toml")
    bad = write(tmp_path, '[[tenant]]\nname = "a"\nweight = \n')
    with pytest.raises(ConfigError, match=r"invalid TOML: .*line 3") as e:
        load_tenants(bad)
    assert str(bad) in str(e.value)
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_tenants(binary)
    with pytest.raises(ConfigError, match="cannot read"):
        load_tenants(tmp_path)  # a directory


# ---- identity -------------------------------------------------------------------------------


@pytest.fixture
def keyed(tmp_path):
    return load_tenants(write(tmp_path, GOOD))


def test_keys_decide_identity_alone(keyed):
    headers = {"authorization": "Bearer sk-globex", "x-client-id": "acme"}
    client, tenant = identity_from_headers(keyed, headers, body_user="acme", routing_key="acme")
    assert (client, tenant) == ("globex", keyed.get("globex"))
    assert identity_from_headers(keyed, {"authorization": "bearer  sk-acme-1 "})[0] == "acme"


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({}, "missing API key"),
        ({"x-client-id": "acme"}, "missing API key"),
        ({"authorization": ""}, "missing API key"),
        ({"authorization": "Bearer"}, "missing API key"),
        ({"authorization": "Basic sk-acme-1"}, "missing API key"),
        ({"authorization": "Bearer sk-wrong"}, "invalid API key"),
        ({"authorization": "Bearer sk-acme-1x"}, "invalid API key"),
    ],
)
def test_auth_errors(keyed, headers, message):
    with pytest.raises(AuthError) as e:
        identity_from_headers(keyed, headers, body_user="acme")
    assert e.value.message.startswith(message)


def test_identity_without_keys(tmp_path):
    table = load_tenants(write(tmp_path, '[[tenant]]\nname = "alice"\nweight = 3\n'))
    for t in (table, None):
        assert identity_from_headers(t, {"x-client-id": "bob"}, "carol", "dave")[0] == "bob"
        assert identity_from_headers(t, {}, "carol", "dave")[0] == "carol"
        assert identity_from_headers(t, {}, None, "dave")[0] == "dave"
        assert identity_from_headers(t, {}) == ("default", None)
    assert identity_from_headers(table, {"x-client-id": "alice"}) == ("alice", table.get("alice"))
    assert identity_from_headers(None, {"x-client-id": "alice"}) == ("alice", None)
    # an Authorization header means nothing without keys
    assert identity_from_headers(table, {"authorization": "Bearer x"}, "carol")[0] == "carol"


@pytest.mark.parametrize("bad", ["", "a b", "tab\there", "x" * 129, "nl\n", "\x00", "\u200b"])
def test_bad_client_ids(bad):
    with pytest.raises(BadClientId):
        identity_from_headers(None, {"x-client-id": bad})
    with pytest.raises(BadClientId, match="user"):
        identity_from_headers(None, {}, body_user=bad)
    assert issubclass(BadClientId, ValueError)


def test_good_client_ids():
    for good in ("a", "x" * 128, "team/alice@example.com", "客户-1"):
        assert validate_client_id(good) == good


def test_table_from_code():
    table = TenantTable([Tenant("a", ("k",)), Tenant("b", ("k2",), weight=2)])
    assert table.by_key("k2").name == "b" and table.weights == {"a": 1.0, "b": 2.0}
    with pytest.raises(ConfigError, match="duplicate tenant name"):
        TenantTable([Tenant("a"), Tenant("a")])


# ---- rate limiting --------------------------------------------------------------------------


def test_token_bucket_burst_then_rate():
    lim = RateLimiter(rpm=120, burst=3, now=100.0)  # 2 a second
    assert [lim.try_acquire(100.0) for _ in range(3)] == [None, None, None]
    assert lim.try_acquire(100.0) == pytest.approx(0.5)  # one token in 0.5 s
    assert lim.try_acquire(100.25) == pytest.approx(0.25)  # refusals are not charged
    assert lim.try_acquire(100.5) is None
    assert lim.try_acquire(100.5) == pytest.approx(0.5)
    assert lim.available(200.0) == 3.0  # refill is capped at burst


def test_token_bucket_never_refuses_a_client_under_its_rate():
    lim = RateLimiter(60, burst=1, now=0.0)
    assert all(lim.try_acquire(t * 1.0) is None for t in range(100))


def test_token_bucket_bound_and_retry_after():
    """Over T seconds at most burst + rate*T are admitted, and retrying after the returned
    wait always succeeds."""
    lim = RateLimiter(10, burst=4, now=0.0)
    admitted, t = 0, 0.0
    while t < 600.0:
        wait = lim.try_acquire(t)
        if wait is None:
            admitted += 1
        else:
            assert wait > 0 and lim.try_acquire(t + wait) is None
            admitted += 1
            t += wait
        t += 0.7
    assert admitted <= 4 + 10 / 60 * t + 1e-9


def test_token_bucket_clock_steps_back():
    lim = RateLimiter(60, burst=1, now=10.0)
    assert lim.try_acquire(10.0) is None
    assert lim.try_acquire(5.0) == pytest.approx(1.0)  # no time passed, no refill
    assert lim.try_acquire(11.0) is None


def test_tenant_limiter_from_rpm(keyed):
    acme, globex = keyed.tenants
    lim = acme.make_limiter(now=0.0)
    assert (lim.rate_per_s, lim.burst) == (10.0, 600.0)  # burst defaults to rpm
    g = globex.make_limiter(now=0.0)
    assert [g.try_acquire(0.0) is None for _ in range(6)] == [True] * 5 + [False]
    assert Tenant("x").make_limiter(0.0) is None
    assert RateLimiter(30).burst == 30.0  # a minute's allowance by default
    with pytest.raises(ValueError):
        RateLimiter(0)
    with pytest.raises(ValueError):
        RateLimiter(60, burst=0.5)
