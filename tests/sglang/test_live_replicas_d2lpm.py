"""Two router replicas running D2LPM over two real SGLang servers on this CPU, the servers'
plugin running FCFS: the router's decisions, not the plugin's order, do the work.

What the router decides here: D2LPM picks a *server* for each call and sends it at once
(``router/service.py``: ``submit`` → ``Router.dispatch`` → the bridge's ``/generate``); the
router keeps no queue of its own, so it never orders calls, and with ``--max-running-requests``
small the backlog waits in the chosen server, in FCFS order. So the tests look at where each
replica sends each client's calls (each replica's ``/server_info``: ``dispatched`` per worker):

* a flood through replica 0 stays on the server holding its prefix (locality: every call
  after the first matches it in replica 0's tree; ``max_queue_ratio=inf``, the paper's exact
  rule), and a victim through replica 1 goes to the other server (least queued, counting
  replica 0's requests there): it is served ahead of the flood's backlog, which FCFS alone
  would not do;
* the shared (replica, client) service rows change a decision: a heavy client and a light
  client each send one call through replica 0 (to the same server), then one through
  replica 1 with the same prefix. Replica 1 has seen neither before, and both prefixes are on
  that server; only through the plugin's ledger rows (``/server_info``, read by replica 1's
  bridge) does it know the heavy client's service there is past one quantum, so D2LPM moves
  the heavy client's call off that server and keeps the light one on it. Without the rows
  both stay (checked by hand: with the bridge's ledger read off, the heavy call stays).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

import httpx
import live_rig
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "router"))  # the launcher helpers
from live_helpers import launched_replicas, metric  # noqa: E402

pytestmark = [pytest.mark.sglang_server, pytest.mark.slow]

QUANTUM = 1000  # D2LPM's Q_u (service units: w_e·extend + w_o·output)
OUTPUT_WEIGHT = 0.1  # w_o: the flood's whole service stays below Q_u however its calls
# interleave (49 + 24 extend, 25 × 192 outputs: 553), so it stays where its prefix is
HEAVY_LEN, LIGHT_LEN = 1500, 64  # one call each through replica 0: past Q_u, well below it
N_OUT = 8
FLOOD_OUT = 192  # 24 of them queued behind 2 running: a backlog of ~8 s here


@pytest.fixture(scope="module")
def replicas(tiny_model, tmp_path_factory):
    args = (
        "--backend", "sglang", "--dp", "2", "--router-replicas", "2",
        "--model-path", str(tiny_model), "--schedule-policy", "fcfs",
        "--router-policy", "d2lpm", "--router-policy-opt", f"quantum={QUANTUM}",
        "--router-policy-opt", f"output_weight={OUTPUT_WEIGHT}",
        "--router-policy-opt", "max_queue_ratio=inf",
        "--heartbeat-timeout", "30", *live_rig.CPU_FLAGS,
        "--max-running-requests", "2", "--chunked-prefill-size", "512",
    )  # fmt: skip

    def ready(urls):  # both replicas up, each with a baseline report from both servers
        texts = [httpx.get(u + "/metrics", timeout=5).text for u in urls]
        return all(metric(t, "sgl_fair_replica_reports_baseline_total") >= 2 for t in texts)

    with launched_replicas(*args, tmp_path=tmp_path_factory.mktemp("replicas-d2lpm"),
                           env=live_rig.server_env(cores="0|1"), ready=ready) as up:  # fmt: skip
        yield up


def _info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()


def _dispatched(url: str) -> list[int]:
    """A replica's dispatches so far, per worker (by worker id)."""
    return [w["dispatched"] for w in sorted(_info(url)["workers"], key=lambda w: w["id"])]


def _since(url: str, before: list[int]) -> list[int]:
    return [a - b for a, b in zip(_dispatched(url), before, strict=True)]


def _ids(seed: int, n: int) -> list[int]:
    """``n`` token ids of a prompt no other client's shares a first token with."""
    rng = random.Random(seed)
    return [20 + seed, *(rng.randrange(10, 250) for _ in range(n - 1))]


async def _generate(http, url, client, ids, n_out):
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n_out, "ignore_eos": True, "temperature": 0},
        "routing_key": client,
    }
    r = await http.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return client, time.monotonic()


def _call(url, client, ids, n_out=N_OUT):
    async def main():
        async with httpx.AsyncClient() as http:
            return await _generate(http, url, client, ids, n_out)

    return asyncio.run(main())


def _until_idle(urls: list[str], timeout_s: float = 120.0) -> None:
    """Until every replica counts no request on any server (its own and, from the servers'
    ledgers, the other replica's)."""
    deadline = time.monotonic() + timeout_s
    while True:
        queues = [w["queue_len"] for u in urls for w in _info(u)["workers"]]
        if not any(queues):
            return
        assert time.monotonic() < deadline, queues
        time.sleep(0.2)


def _until_reports(url: str, n: int, timeout_s: float = 30.0) -> None:
    """Until the replica at ``url`` has taken ``n`` more service reports from the servers."""
    start = metric(httpx.get(url + "/metrics", timeout=5).text, "sgl_fair_replica_reports_total")
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(url + "/metrics", timeout=5).text
        if metric(text, "sgl_fair_replica_reports_total") >= start + n:
            return
        assert time.monotonic() < deadline, text
        time.sleep(0.2)


async def _until_counted(
    http, url: str, worker: int, n: int, sender: str, timeout_s: float = 20.0
) -> None:
    """Until the replica at ``url`` counts ``n`` requests on ``worker`` (``sender``: the
    replica that sent them, whose dispatches a failure shows)."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = (await http.get(url + "/server_info", timeout=10)).json()["workers"]
        if next(w["queue_len"] for w in workers if w["id"] == worker) >= n:
            return
        assert time.monotonic() < deadline, (workers, _dispatched(sender))
        await asyncio.sleep(0.1)


def test_a_victim_through_replica_1_is_placed_off_a_flood_through_replica_0(replicas):
    _, (a, b) = replicas
    _until_idle([a, b])
    servers = [w["url"] for w in sorted(_info(a)["workers"], key=lambda w: w["id"])]
    assert _info(servers[0])["internal_states"][0]["sgl_fair"]["policy"] == "fcfs"
    flood = _ids(1, 48)  # every flood call's prefix
    before_a, before_b = _dispatched(a), _dispatched(b)

    async def main() -> list[tuple[str, float]]:
        async with httpx.AsyncClient() as http:
            first = await _generate(http, a, "flood", [*flood, 99], FLOOD_OUT)  # holds the prefix
            f = _since(a, before_a).index(1)
            calls = [
                asyncio.create_task(_generate(http, a, "flood", [*flood, 100 + i], FLOOD_OUT))
                for i in range(24)
            ]
            await _until_counted(http, b, f, 16, a)  # by replica 1, from the servers' rows
            sent = time.monotonic()
            victim = [
                asyncio.create_task(_generate(http, b, "victim", [*_ids(2, 16), 100 + i], 8))
                for i in range(3)
            ]
            done = await asyncio.gather(*calls, *victim)
        return sorted([first, ("sent", sent), *done], key=lambda x: x[1])

    order = asyncio.run(main())
    to_a, to_b = _since(a, before_a), _since(b, before_b)
    f = to_a.index(max(to_a))
    assert to_a[f] == 25 and sum(to_a) == 25, to_a  # the flood stays on its prefix's server
    assert to_b[1 - f] == 3 and sum(to_b) == 3, to_b  # the victim goes to the other one
    sent = next(i for i, (c, _) in enumerate(order) if c == "sent")
    last = max(i for i, (c, _) in enumerate(order) if c == "victim")
    flood_between = sum(1 for c, _ in order[sent:last] if c == "flood")
    flood_after = sum(1 for c, _ in order[last:] if c == "flood")
    seen = [(c, round(t - order[0][1], 2)) for c, t in order]
    assert flood_between <= 4, seen  # FCFS on the flood's server: 14+ ahead of it
    assert flood_after >= 8, seen  # ... and the backlog was there


def test_the_shared_rows_move_a_heavy_clients_call_off_the_server_it_used(replicas):
    """Replica 1 meets both clients first in replica 0's rows: the light one's service there
    is below one quantum, the heavy one's past it. (This found a bug: with sliding deficits a
    client first charged by a report started the other servers level with the charged one,
    so the heavy call stayed; ``D2LPM.on_peer_service`` now starts a new client at 0.)"""
    _, (a, b) = replicas
    _until_idle([a, b])
    heavy, light = _ids(3, HEAVY_LEN), _ids(4, LIGHT_LEN)
    first = []
    for client, ids in (("heavy", heavy), ("light", light)):  # through replica 0
        before = _dispatched(a)
        _call(a, client, ids)
        first.append(_since(a, before))
        _until_idle([a, b])
    assert first[0] == first[1] and sum(first[0]) == 1, first  # both on one server
    x = first[0].index(1)
    _until_reports(b, 8)  # replica 1 took the rows of both calls, finished, from both servers
    then = []
    for client, ids in (("light", light), ("heavy", heavy)):  # through replica 1
        before = _dispatched(b)
        _call(b, client, [*ids, 5, 6, 7])
        then.append(_since(b, before))
        _until_idle([a, b])
    light_to, heavy_to = then[0].index(1), then[1].index(1)
    assert light_to == x, then  # the light client's prefix keeps it where it was
    assert heavy_to != x, (then, x)  # the heavy one's service there, from replica 0's rows
