"""Where the bridge runs: inside the router's process and loop (``--bridges router``, the
default) or a process per server (``--bridges process``). The same ``Bridge`` either way; what
differs is the link (``worker/sglang/bridge_link.py``) and what the router's watch reads.

End to end against a stand-in SGLang server (``launch --backend sim``, as in
``test_sglang_bridge.py``): a call streams and is aborted in both modes, and the worker's pid
says where its bridge runs. Then a bridge inside the router that stops (its server never
answers) is a worker the router's watch sees exit, while the router lives on.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))  # live_helpers
from live_helpers import free_port, launched  # noqa: E402
from test_sglang_bridge import standin  # noqa: E402

from sgl_fair.messages import Hello, Load, Shutdown  # noqa: E402
from sgl_fair.worker.sglang.bridge import Bridge, BridgeConfig  # noqa: E402
from sgl_fair.worker.sglang.bridge_link import HostedBridge, LocalLink  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["router", "process"])
def test_a_call_streams_through_either_bridge_and_the_pid_says_where_it_runs(tmp_path, mode):
    with (
        standin(tmp_path, "--time-scale", "4") as (sin, kv),
        launched("--worker-url", sin.url, "--worker-kv-endpoint", kv, "--bridges", mode,
                 tmp_path=tmp_path) as outer,
    ):  # fmt: skip
        [w] = outer.info()["workers"]
        assert (w["pid"] == outer.proc.pid) is (mode == "router"), (w, outer.proc.pid)
        body = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 6},
                "stream": True}  # fmt: skip
        with httpx.stream("POST", outer.url + "/generate", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            chunks = [json.loads(x[6:]) for x in resp.iter_lines()
                      if x.startswith("data: ") and x != "data: [DONE]"]  # fmt: skip
        assert len(chunks[-1]["output_ids"]) == 6
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"

        async def aborted() -> dict:  # a long call aborted by its rid while it streams
            async with httpx.AsyncClient(timeout=60) as http:
                params = {"max_new_tokens": 5000, "ignore_eos": True}
                long = {"input_ids": [7, 8], "rid": "long-1", "sampling_params": params}
                call = asyncio.ensure_future(http.post(outer.url + "/generate", json=long))
                await asyncio.sleep(1.0)
                r = await http.post(outer.url + "/abort_request", json={"rid": "long-1"})
                assert r.status_code == 200, r.text
                return (await call).json()

        out = asyncio.run(aborted())
        assert out["meta_info"]["finish_reason"]["type"] == "abort", out["meta_info"]
        assert out["meta_info"]["completion_tokens"] < 5000


def test_a_bridge_inside_the_router_that_stops_is_seen_to_exit():
    """Its server never answers: the bridge stops (code 2, not ready in time), the watch sees
    an exit code as it would a process's, and nothing reaches the router but what it sent."""
    got: list = []
    cfg = BridgeConfig(wid=0, endpoints="unused", url=f"http://127.0.0.1:{free_port()}",
                       startup_timeout_s=0.3, health_timeout_s=0.2)  # fmt: skip

    async def main() -> HostedBridge:
        hosted = HostedBridge(Bridge(cfg, LocalLink(got.append)))
        assert hosted.exitcode is None and not hosted.is_alive()  # not started
        hosted.start()
        assert hosted.is_alive() and hosted.exitcode is None
        await asyncio.wait_for(asyncio.shield(hosted.task), 10)
        hosted.handle(Shutdown(0))  # to a bridge that is gone: dropped, never raised
        await asyncio.sleep(0)
        return hosted

    hosted = asyncio.run(main())
    assert not hosted.is_alive() and hosted.exitcode == 2
    assert got == []  # never ready: no Hello, no Load


def test_messages_cross_as_objects_and_shutdown_stops_it(tmp_path):
    """A bridge inside the router says Hello and Loads to the router's handler as objects
    (no encoding); the router's Shutdown, handed over on the loop's next pass, ends it (0)."""
    got: list = []
    with standin(tmp_path, "--time-scale", "4") as (sin, _kv):
        cfg = BridgeConfig(wid=5, endpoints="unused", url=sin.url, load_interval_s=0.05)

        async def main() -> HostedBridge:
            hosted = HostedBridge(Bridge(cfg, LocalLink(got.append)))
            hosted.start()
            for _ in range(200):
                if any(isinstance(m, Load) for m in got):
                    break
                await asyncio.sleep(0.05)
            hosted.handle(Shutdown(5))
            await asyncio.wait_for(asyncio.shield(hosted.task), 10)
            return hosted

        hosted = asyncio.run(main())
    assert isinstance(got[0], Hello) and got[0].worker == 5
    assert any(isinstance(m, Load) and m.boot == got[0].boot for m in got)
    assert hosted.exitcode == 0 and not hosted.is_alive()
