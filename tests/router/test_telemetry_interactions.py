"""FairServe's measures on /metrics (``router/telemetry_interactions.py``), call by call."""

from __future__ import annotations

import pytest
from live_helpers import metric

from sgl_fair.records import QUEUED_S
from sgl_fair.router.telemetry import MAX_APP_LABELS, Telemetry


def answered(t, user, iid, *, tenant="acme", app="agent", tokens=10, queue_s=0.0, ttft_s=0.1):
    t.interactions.answered(tenant, app, user, iid, tokens=tokens, output_len=4,
                            ttft_s=ttft_s, queue_s=queue_s)  # fmt: skip


def read(t: Telemetry, name: str, **labels: str) -> float:
    return metric(t.render().decode(), "sgl_fair_" + name, **labels)


def test_users_are_counted_once_per_tenant_and_app():
    t = Telemetry()
    answered(t, "u1", "i1")
    answered(t, "u1", "i1", queue_s=QUEUED_S + 0.5)  # waited: counted queued, once
    answered(t, "u1", "i2", queue_s=QUEUED_S + 3.0)
    answered(t, "u2", "i3", queue_s=QUEUED_S)  # not over the threshold
    t.interactions.seen("acme", "agent", "u3")  # e.g. refused for capacity
    answered(t, "u1", "j1", app="judge")  # the same user under another app
    assert read(t, "users_total", app="agent") == 3
    assert read(t, "users_served_total", app="agent") == 2
    assert read(t, "users_queued_total", app="agent") == 1
    assert read(t, "users_total", app="judge") == 1
    assert read(t, "queue_delay_seconds_count", app="agent") == 4
    assert read(t, "app_ttft_seconds_count", tenant="acme") == 5
    assert read(t, "app_output_tokens_total", app="agent") == 16


def test_a_throttled_interaction_wastes_what_its_answered_calls_spent():
    t = Telemetry()
    answered(t, "u1", "i1", tokens=30)
    answered(t, "u1", "i1", tokens=12)
    answered(t, "u2", "i2", tokens=99)  # another interaction: not wasted
    t.interactions.throttled("acme", "agent", "u1", "i1")
    t.interactions.throttled("acme", "agent", "u1", "i1")  # the same interaction again
    answered(t, "u1", "i1", tokens=5)  # spent after the throttle: wasted too
    assert read(t, "interactions_throttled_total") == 1
    assert read(t, "tokens_wasted_total", tenant="acme", app="agent") == 30 + 12 + 5
    assert read(t, "users_throttled_total") == 1


def test_a_throttled_call_of_its_own_is_one_interaction_and_wastes_nothing():
    t = Telemetry()
    t.interactions.throttled("acme", "chat", "u1", None)
    t.interactions.throttled("acme", "chat", "u1", None)
    assert read(t, "interactions_throttled_total", app="chat") == 2
    assert read(t, "tokens_wasted_total") == 0
    assert read(t, "users_throttled_total", app="chat") == 1
    assert read(t, "users_total", app="chat") == 1


def test_interaction_ids_are_per_tenant():
    t = Telemetry()
    answered(t, "u1", "job", tenant="acme", tokens=7)
    t.interactions.throttled("evil", "agent", "u9", "job")  # not acme's interaction
    assert read(t, "tokens_wasted_total") == 0
    assert read(t, "interactions_throttled_total", tenant="evil") == 1


def test_memory_is_bounded_least_recently_seen_forgotten_first():
    t = Telemetry()
    t.interactions.max_tracked = 2
    answered(t, "u1", "i1", tokens=5)
    answered(t, "u2", "i2")
    answered(t, "u1", "i1")  # u1 / i1 seen again: u2 / i2 are now the oldest
    answered(t, "u3", "i3")  # forgets u2 and i2
    assert len(t.interactions._users) == 2 and len(t.interactions._interactions) == 2
    t.interactions.throttled("acme", "agent", "u1", "i1")  # still remembered: 5 + 10 wasted
    assert read(t, "tokens_wasted_total") == 15
    answered(t, "u2", "i2")  # forgotten, so counted again
    assert read(t, "users_total") == 4


def test_app_labels_are_bounded_as_the_throttle_counter_s():
    t = Telemetry()
    for i in range(MAX_APP_LABELS + 3):
        answered(t, "u", f"i{i}", app=f"app{i}")
    assert read(t, "users_total", app="other") == 1  # one user, counted once under "other"
    assert read(t, "app_output_tokens_total", app="other") == 3 * 4


def test_max_tracked_must_be_positive():
    from prometheus_client import CollectorRegistry

    from sgl_fair.router.telemetry_interactions import InteractionMetrics

    with pytest.raises(ValueError, match="max_tracked"):
        InteractionMetrics(CollectorRegistry(), (1.0,), str, max_tracked=0)


def test_every_metric_operators_md_lists_is_exported():
    """docs/operators.md's "What to watch" names only metrics /metrics really has."""
    import re
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "operators.md").read_text()
    text = Telemetry().render().decode()
    exported = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)", text, re.M):
        exported |= {name, name + "_total"} if kind == "counter" else {name}
    rows = [line for line in doc.splitlines() if line.startswith("| `sgl_fair_")]
    assert len(rows) >= 12
    for row in rows:
        cell = row.split("|")[1]
        names = re.findall(r"`(sgl_fair_[a-z0-9_]+)", cell)
        first = names[0].split("_")
        for short in re.findall(r"`…_([a-z0-9_]+)`", cell):  # `…_waiting` after a full name
            candidates = ["_".join(first[:k]) + "_" + short for k in range(2, len(first))]
            assert any(c in exported for c in candidates), (row, short)
        for name in names:
            assert name in exported, (row, name)
