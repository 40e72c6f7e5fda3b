"""The cluster OIT's defects found by the audit of issue 31 (``router/oit.py``).

* ``T_g`` is the user's limit over all its apps, at the router as at the worker;
* an interaction with a call in flight through the router is never idle, however long the
  call runs: its next call is never refused as a new interaction.
"""

from __future__ import annotations

from sgl_fair.router.oit import ClusterOIT
from tests.router.test_cluster_oit import View, req


def test_the_global_user_limit_counts_the_user_over_all_its_apps() -> None:
    view = View()
    o = ClusterOIT(max_waiting=0, limits={"user_limit": 3, "window_s": 60})
    accepted, t = 0, 0.0
    for i in range(4):
        for app in ("chat", "agent", "tot", "judge"):
            t += 0.1
            view.all(t, waiting=3)
            accepted += o.on_arrival(req("u", iid=f"{app}-{i}", app=app, t=t), t, view) is None
    assert accepted == 3


def test_a_call_in_flight_longer_than_the_timeout_keeps_its_interaction_alive() -> None:
    view = View()
    o = ClusterOIT(
        max_waiting=0, interaction_timeout_s=120, limits={"user_limit": 1, "window_s": 1000}
    )
    view.all(0.0, waiting=3)
    first = req("u", iid="i", t=0.0)
    assert o.on_arrival(first, 0.0, view) is None  # dispatched; runs (or waits) 300 s
    view.all(300.0, waiting=3)
    assert o.on_arrival(req("u", iid="i", t=300.0), 300.0, view) is None, "429 mid-interaction"
    assert o.on_arrival(req("u", iid="new", t=300.0), 300.0, view) is not None
    o.on_finished(first.rid, 310.0)
    # the second call of "i" is still open: "i" stays alive however long it takes
    view.all(1000.0, waiting=3)
    assert o.in_flight("i", 1000.0)


def test_an_interaction_ends_a_timeout_after_its_last_open_call() -> None:
    view = View()
    o = ClusterOIT(max_waiting=0, interaction_timeout_s=120, limits={"user_limit": 0})
    view.all(0.0)
    first = req("u", iid="i", t=0.0)
    assert o.on_arrival(first, 0.0, view) is None
    o.on_finished(first.rid, 300.0)
    assert o.in_flight("i", 419.0) and not o.in_flight("i", 421.0)
    view.all(421.0, waiting=3)
    assert o.on_arrival(req("u", iid="i", t=421.0), 421.0, view) is not None
