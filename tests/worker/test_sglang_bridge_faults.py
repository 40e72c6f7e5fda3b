"""A server that dies under load fails no call the router could still retry.

The bridge sees its server die twice over: the calls it streams fail with a transport error,
and its health checks fail. Whichever the router hears first, a call no token of which reached
its client must be re-dispatched to a live server, not failed: the bridge says the call was
*lost* with its server (``Finished.lost``), and the router takes that as the worker's death.
Before, the transport error came back as a plain abort, ahead of the worker's death, and the
call failed (issue 39: ``test_a_killed_sglang_server_is_routed_around`` failed under load).

End to end: the router is ``launch --worker-url victim --worker-url survivor``, each a stand-in
SGLang server (``launch --backend sim``); the victim is killed with requests in flight.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))  # live_helpers
from live_helpers import launched  # noqa: E402
from sglang_standin import BridgeRig  # noqa: E402
from test_sglang_bridge import _start_victim, standin  # noqa: E402

from sgl_fair.messages import FinishReason  # noqa: E402


@pytest.mark.slow
def test_calls_on_a_killed_server_finish_on_the_other(tmp_path):
    victim, victim_url = _start_victim(tmp_path)
    try:
        with (
            standin(tmp_path, "--time-scale", "4") as (_survivor, _kv),
            launched(
                "--worker-url", victim_url, "--worker-url", _survivor.url,
                "--router-policy", "rr",
                # the bridge's own health checks are slow here: the calls' transport errors
                # come first, as with SGLang's default health interval
                "--health-check-interval", "5", "--health-check-timeout", "30",
                tmp_path=tmp_path,
            ) as outer,
        ):  # fmt: skip

            async def load() -> list[httpx.Response]:
                async with httpx.AsyncClient(timeout=120) as http:
                    body = {"sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}
                    calls = [
                        http.post(outer.url + "/generate", json={**body, "text": f"call {i}"})
                        for i in range(8)
                    ]
                    running = asyncio.gather(*calls)
                    await asyncio.sleep(0.5)  # every call is on a server, none finished
                    victim.send_signal(signal.SIGKILL)
                    return await running

            t0 = time.monotonic()
            results = asyncio.run(load())
            assert [r.status_code for r in results] == [200] * 8, [r.text for r in results]
            tokens = [r.json()["meta_info"]["completion_tokens"] for r in results]
            assert tokens == [600] * 8, [r.json()["meta_info"]["finish_reason"] for r in results]
            assert time.monotonic() - t0 < 60
            w0 = outer.info()["workers"][0]
            assert not w0["alive"], w0
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait(10)


def test_a_call_cut_by_its_server_is_reported_lost(tmp_path):
    """The bridge alone: the server goes away mid-stream; the call's Finished says lost."""
    from sglang_standin import StandInSGLang

    server = StandInSGLang(token_interval_s=0.05)
    with server, BridgeRig(str(tmp_path), server.url, health_interval_s=30.0) as rig:
        assert rig.hello() is not None
        rig.dispatch("r-1", 200)
        assert rig.recv_until(lambda m: False, timeout_s=0.5) is None
        assert server.running
        server.die()  # its listener and every connection go (kill -9 of its process)
        done = rig.finished({"r-1"})
        assert done["r-1"].reason is FinishReason.ABORTED
        assert done["r-1"].lost, done["r-1"]
        # and a call that comes while the server is down is lost at once
        rig.dispatch("r-2", 5)
        again = rig.finished({"r-2"}, timeout_s=5)
        assert again["r-2"].lost, again
