"""Fairness end to end: a flooding tenant against a victim, live, compared with the simulator.

The same open-loop trace (Poisson arrivals, fixed lengths) runs twice: through the
discrete-event simulator with VTC and FCFS, and through ``launch --dp 1 --schedule-policy
vtc`` in wall-clock time. The live victim's share of service and its median latency must
land near the simulator's VTC prediction — and clearly above what FCFS would give it.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest
from live_helpers import launched

from sgl_fair.policies import make_policy
from sgl_fair.worker.sim.cost_model import CostModel
from sgl_fair.worker.sim.runner import make_sim_worker, simulate
from sgl_fair.workloads.arrivals import Poisson
from sgl_fair.workloads.traces import ClientSpec, generate

pytestmark = pytest.mark.slow

T = 12.0
GPU, MODEL, KV = "A10G", "Llama-2-7B", 10_000
SPECS = [
    ClientSpec("victim", Poisson(3.0), 256, 32),
    ClientSpec("flood", Poisson(30.0), 256, 32),
]


def _share_and_p50(finished: list[tuple[str, int, int, int, float]]) -> tuple[float, float]:
    """(victim's share of service, victim's median latency) from finished requests:
    (client, input_len, cached, output_len, latency_s)."""
    service = {"victim": 0.0, "flood": 0.0}
    lat = []
    for client, n_in, cached, n_out, latency in finished:
        service[client] += (n_in - cached) + 2 * n_out
        if client == "victim":
            lat.append(latency)
    total = sum(service.values())
    return service["victim"] / total, float(np.median(lat))


def _simulate(policy: str, requests) -> tuple[float, float]:
    sched, engine = make_sim_worker(
        policy=make_policy(policy), cost_model=CostModel.from_names(GPU, MODEL), kv_tokens=KV
    )
    res = simulate(
        [r.unscheduled_copy() for r in requests], scheduler=sched, engine=engine, until_s=T
    )
    done = [
        (r.client, r.input_len, r.prefix_len, r.num_output, r.finish_s - r.arrival_s)
        for r in res.records()
        if r.finish_s is not None and r.finish_s <= T
    ]
    return _share_and_p50(done)


async def _drive(url: str, requests) -> list[tuple[str, int, int, int, float]]:
    done: list[tuple[str, int, int, int, float]] = []
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        t0 = time.monotonic()

        async def one(req) -> None:
            await asyncio.sleep(max(0.0, req.arrival_s - (time.monotonic() - t0)))
            sent = time.monotonic()
            r = await client.post(
                url + "/generate",
                json={
                    "input_ids": list(req.input_ids),
                    "sampling_params": {"max_new_tokens": req.output_len, "ignore_eos": True},
                },
                headers={"X-Client-Id": req.client},
            )
            r.raise_for_status()
            end = time.monotonic()
            meta = r.json()["meta_info"]
            if end - t0 <= T:
                done.append(
                    (
                        req.client,
                        meta["prompt_tokens"],
                        meta["cached_tokens"],
                        meta["completion_tokens"],
                        end - sent,
                    )
                )

        tasks = [asyncio.ensure_future(one(r)) for r in requests]
        # What finishes after T does not count: hang up then (the server aborts those).
        await asyncio.wait(tasks, timeout=T + 0.2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return done


def test_victim_gets_the_share_the_simulator_predicts(tmp_path):
    requests = generate(SPECS, duration_s=T, seed=3)
    sim_vtc_share, sim_vtc_p50 = _simulate("vtc", requests)
    sim_fcfs_share, _ = _simulate("fcfs", requests)
    assert sim_vtc_share > sim_fcfs_share + 0.08  # the scenario separates the policies
    args = ("--dp", "1", "--schedule-policy", "vtc", "--gpu", GPU, "--model", MODEL)
    with launched(*args, "--kv-tokens", str(KV), tmp_path=tmp_path) as s:
        live = asyncio.run(_drive(s.url, requests))
    share, p50 = _share_and_p50(live)
    print(f"victim share live {share:.3f} sim vtc {sim_vtc_share:.3f} fcfs {sim_fcfs_share:.3f}")
    print(f"victim p50 live {p50:.2f}s sim vtc {sim_vtc_p50:.2f}s")
    assert abs(share - sim_vtc_share) < 0.08, (share, sim_vtc_share, sim_fcfs_share)
    assert share > sim_fcfs_share + 0.04, (share, sim_fcfs_share)
    assert p50 < 1.5 * sim_vtc_p50 + 0.5, (p50, sim_vtc_p50)
