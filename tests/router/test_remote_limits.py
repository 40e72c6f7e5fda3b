"""A router over standalone workers (``--worker-endpoint``) serves the workers' own limits.

The router starts before it hears from its workers, from its own ``--model``'s numbers; a
remote worker's Hello carries its KV pool and its model's context length, and once every
worker has said Hello the router adopts them, as it adopts an SGLang server's. Before, a
router over a worker running a 4,096-token model advertised its default model's 131,072 and
passed a 5,000-token prompt to the worker, which could never serve it.
"""

from __future__ import annotations

import httpx
from live_helpers import launched
from remote_helpers import free_port_pair, start_worker


def test_the_router_adopts_its_remote_workers_context_length(tmp_path):
    port = free_port_pair()
    worker = start_worker(port, "--model", "Llama-2-7B", "--sim-eos", "off")
    try:
        with launched("--worker-endpoint", f"tcp://127.0.0.1:{port}", tmp_path=tmp_path) as live:
            models = httpx.get(live.url + "/v1/models", timeout=10).json()
            assert models["data"][0]["max_model_len"] == 4096, models
            info = live.info()
            assert info["context_length"] == 4096, info
            too_long = httpx.post(
                live.url + "/generate",
                json={"input_ids": [5] * 5000, "sampling_params": {"max_new_tokens": 4}},
                timeout=30,
            )
            assert too_long.status_code == 400, too_long.text
            assert "4096" in too_long.text
            ok = httpx.post(
                live.url + "/generate",
                json={"input_ids": [5] * 100, "sampling_params": {"max_new_tokens": 4}},
                timeout=30,
            )
            assert ok.status_code == 200, ok.text
            assert ok.json()["meta_info"]["completion_tokens"] == 4
            worker.kill()  # not the launcher's: it must not outlive the test
            worker.wait(10)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
