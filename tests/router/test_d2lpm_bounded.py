"""D2LPM's per-client state is bounded (issue 31 item 6): client ids come from a header
without API keys, so 20,000 one-shot clients used to leave 20,000 deficit tables."""

from __future__ import annotations

import pytest
from router_helpers import finished, make_req
from test_d2lpm import d2lpm


@pytest.mark.parametrize("load", ["requests", "tokens"])
def test_one_shot_clients_leave_at_most_max_clients_deficits(load) -> None:
    r, p = d2lpm(num_workers=4, deficits="sliding", load=load)
    for i in range(20_000):
        req = make_req(range(i, i + 8), f"c{i}")
        w = r.dispatch(req, 0.0).worker
        r.handle(finished(w, req, (1, 2)), 0.0)
    assert len(p._deficits) <= 10_000
    if p._work is not None:
        assert len(p._work._outputs) <= 10_000
    assert p.num_forgotten == 10_000


def test_the_least_recently_active_client_is_forgotten_first() -> None:
    r, p = d2lpm(num_workers=2, deficits="sliding", max_clients=2)
    a, b, c = (make_req(range(k * 100, k * 100 + 50), name) for k, name in enumerate("abc"))
    for req in (a, b):
        r.dispatch(req, 0.0)
    r.handle(finished(r.inflight[a.rid][0], a, (1,)), 0.0)  # a active again: b is older
    r.dispatch(c, 0.0)
    assert set(p._deficits) == {"a", "c"}
    with pytest.raises(ValueError, match="max_clients"):
        d2lpm(max_clients=0)
