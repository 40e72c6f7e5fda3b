"""SGLang 0.5.23's own client code against the live simulated server (issue 19).

The frontend language through the stock ``RuntimeEndpoint`` (no subclass): ``gen`` with stop
strings that fire on the simulated text, ``select``, ``fork``, ``run_batch``; and the body
SGLang's ``GenerateReqInput`` serializes to with every field at its default (plus what a
gateway adds), posted as is.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import httpx
import pytest

sgl = pytest.importorskip("sglang")

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint  # noqa: E402
from sglang.srt.managers.io_struct import GenerateReqInput  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "router"))  # the launcher helpers
from live_helpers import launched  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Error in stream_executor")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sglclients")
    args = ("--backend", "sim", "--dp", "2", "--time-scale", "inf", "--sim-eos", "off")
    with launched(*args, tmp_path=tmp) as live:
        yield live


@sgl.function
def qa(s, question):
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=300, stop=["."])
    s += "\nVerdict:" + sgl.select("verdict", choices=["yes", "no"])


@sgl.function
def branches(s):
    s += "Think about it."
    forks = s.fork(3)
    for f in forks:
        f += sgl.gen("idea", max_tokens=8)
    s += " ".join(f["idea"] for f in forks)


def test_runtime_endpoint_gen_stop_select_fork_and_batch(server):
    backend = RuntimeEndpoint(server.url)
    state = qa.run(question="what is it", backend=backend)
    assert state["verdict"] in ("yes", "no")
    answer = state["answer"]
    assert answer and "." not in answer
    meta = state.get_meta_info("answer")
    assert meta["finish_reason"]["type"] == "stop" and meta["finish_reason"]["matched"] == "."
    assert meta["completion_tokens"] < 300
    fork_state = branches.run(backend=backend)
    assert fork_state.text().startswith("Think about it.")
    states = qa.run_batch([{"question": f"q{i}"} for i in range(3)], backend=backend)
    assert all(s["verdict"] in ("yes", "no") for s in states)


def test_generate_req_input_defaults_posted_as_is(server):
    req = GenerateReqInput(text="hello there", sampling_params={"max_new_tokens": 5})
    body = {f.name: getattr(req, f.name) for f in dataclasses.fields(req)}
    body = json.loads(json.dumps(body, default=lambda o: None))
    body.update(model="gateway-model", return_routed_experts=False, gateway_hop=1)
    r = httpx.post(server.url + "/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 5
    # n samples as SGLang's parallel sampling answers them: a list
    body["sampling_params"] = {"max_new_tokens": 3, "n": 2}
    r = httpx.post(server.url + "/generate", json=body, timeout=30)
    assert r.status_code == 200 and len(r.json()) == 2
