"""SPEC options named in issue 31 item 7, each as a named option: VTC's artifact predictor
(``predict="ema"``), RPM's fixed per-minute window (``window="fixed"``), the profiled cost
with SPEC §1's coefficients as written (``cost="profiled-spec"``), FairServe's ``L_S`` from
a request's declared system-prompt length."""

from __future__ import annotations

import pytest

from sgl_fair.cost import make_cost
from sgl_fair.policies import make_policy
from sgl_fair.request import Request


def req(client: str, n_out: int, *, i: int = 0, t: float = 0.0) -> Request:
    return Request(f"r{client}{i}", client, (1,) * 10, n_out, t)


def serve(p, r: Request) -> None:
    assert p.on_arrival(r, r.arrival_s) is None
    p.on_admitted(r, r.input_len)
    r.output_ids = [0] * r.output_len
    p.on_tokens(r, r.output_len)
    p.on_finished(r)


def test_vtc_ema_predicts_the_artifacts_moving_average() -> None:
    p = make_policy("vtc", predict="ema")
    preds = []
    for i, out in enumerate([100, 50, 200, 10]):
        r = req("a", out, i=i)
        preds.append(p._prediction(r))
        serve(p, r)
    # pred <- (4 pred + actual) / 5, the first request predicted 0
    want, pred = [], 0.0
    for out in [100, 50, 200, 10]:
        want.append(round(pred))
        pred = (4 * pred + out) / 5
    assert preds == want == [0, 20, 26, 61]
    assert make_policy("vtc", predict="predict")._prediction(req("b", 5)) is None  # no history


def test_vtc_ema_charges_the_prediction_at_admission_and_refunds_it() -> None:
    p = make_policy("vtc", predict="ema")
    serve(p, req("a", 100))  # predicted 0: charged as produced, 10 + 2 x 100
    assert p.counter("a") == pytest.approx(210)
    r = req("a", 5, i=1)  # predicted 20
    p.on_arrival(r, 0.0)
    p.on_admitted(r, 10)
    assert p.counter("a") == pytest.approx(210 + 10 + 2 * 20)
    r.output_ids = [0] * 5
    p.on_tokens(r, 5)
    p.on_finished(r)  # the unused 15 tokens refunded
    assert p.counter("a") == pytest.approx(210 + 10 + 2 * 5)


@pytest.mark.parametrize("window", ["fixed", "sliding"])
def test_rpm_windows(window) -> None:
    p = make_policy("rpm", limit=2, window_s=60, window=window)
    got = [p.on_arrival(req("a", 1, i=i, t=t), t) is None for i, t in enumerate([50, 55, 59, 61])]
    if window == "fixed":  # [0, 60) holds 2; the count restarts at 60
        assert got == [True, True, False, True]
        assert p.on_arrival(req("a", 1, i=8, t=62), 62) is None
        assert p.on_arrival(req("a", 1, i=9, t=63), 63).retry_after_s == pytest.approx(57)
    else:  # the last 60 s still hold 50 and 55 at 61
        assert got == [True, True, False, False]
    with pytest.raises(ValueError, match="window"):
        make_policy("rpm", window="calendar")


def test_the_profiled_cost_with_specs_coefficients_as_written() -> None:
    spec = make_cost("profiled-spec")
    x, y = 136, 256
    h = 0.21001891 * x + 0.10075395 * y + 0.0039868 * x * y + 0.00324733 * y * y + 1.14601454
    total = spec.input_cost(input_len=x, extend_len=x) + spec.output_cost(
        input_len=x, start=0, end=y
    )
    assert total == pytest.approx(h, rel=1e-12)
    assert make_cost("profiled").h(x, y) == pytest.approx(10 * h, rel=0.02)  # rounded, x10
    assert make_policy("vtc", cost="profiled-spec").config.cost == spec
    assert make_policy("dlpm", cost="profiled-spec").config.cost == spec


def test_fairserve_takes_l_s_from_the_request_before_the_apps_configured_length() -> None:
    p = make_policy("fairserve", system_lens={"chat": 4}, stage_weights={"chat": 1.0})
    r = Request("r", "u", (1,) * 10, 5, 0.0, app="chat")
    assert p.raw_cost(r, 5) == 1 * 6 + 2 * 4 + 5  # the app's configured L_S = 4
    r.system_len = 7  # a chat's system messages, or a declared system-prefix length
    assert p.raw_cost(r, 5) == 1 * 3 + 2 * 7 + 5
    r.system_len = 50  # capped at the input
    assert p.raw_cost(r, 5) == 2 * 10 + 5
    r.system_len = 0  # declared: no system prompt, whatever the app's default
    assert p.raw_cost(r, 5) == 10 + 5
