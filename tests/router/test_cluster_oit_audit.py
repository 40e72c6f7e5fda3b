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
