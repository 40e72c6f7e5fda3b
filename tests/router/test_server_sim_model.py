"""The simulated model behaves like a model: it stops at EOS, and stop strings fire.

Before: a chat request without ``max_tokens`` ran to the context length (a newcomer saw a hung
server), and the pseudo-word output had no punctuation, so ``stop=["."]`` never matched.
"""

from __future__ import annotations

import time

import httpx
import openai
from live_helpers import launched, metric

ARGS = ("--dp", "1", "--time-scale", "inf", "--context-length", "4096")


def test_requests_without_max_tokens_stop_at_eos_and_ignore_eos_runs_to_the_cap(tmp_path):
    with launched(*ARGS, "--sim-eos", "40,0.5", tmp_path=tmp_path) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none")
        lengths = []
        t0 = time.monotonic()
        for i in range(8):
            out = client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": f"question {i}"}]
            )
            assert out.choices[0].finish_reason == "stop"
            lengths.append(out.usage.completion_tokens)
        assert time.monotonic() - t0 < 30
        assert max(lengths) < 400 and len(set(lengths)) > 1  # drawn per request, not the cap
        body = {
            "text": "go on",
            "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
        }
        r = httpx.post(s.url + "/generate", json=body, timeout=60).json()
        assert r["meta_info"]["finish_reason"]["type"] == "length"
        assert r["meta_info"]["completion_tokens"] == 300
        body["sampling_params"]["ignore_eos"] = False
        r = httpx.post(s.url + "/generate", json=body, timeout=60).json()
        if r["meta_info"]["finish_reason"]["type"] == "stop":  # EOS: the built-in </s> = 2
            assert r["meta_info"]["finish_reason"]["matched"] == 2
            assert "</s>" not in r["text"]


def test_stop_strings_fire_on_simulated_text(tmp_path):
    with launched(*ARGS, "--sim-eos", "off", tmp_path=tmp_path) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none")
        for stop in (".", "\n", ","):
            hits = 0
            for i in range(6):
                out = client.completions.create(
                    model="default", prompt=f"tell me {i}", max_tokens=400, stop=[stop]
                )
                choice = out.choices[0]
                assert stop not in choice.text  # SGLang leaves the stop string out
                # A stop matched in the last allowed token is still a stop (SGLang checks
                # stop strings before the length cap), so 400 tokens can finish by "stop".
                assert out.usage.completion_tokens <= 400
                if choice.finish_reason == "stop":
                    hits += 1
            assert hits >= 5, (stop, hits)  # sentences of ~14 words, paragraphs of ~4
        plain = client.completions.create(model="default", prompt="a", max_tokens=200)
        text = plain.choices[0].text
        assert "." in text and "," in text  # it reads like text
        # Every call completed: one the router cut at its stop string counts "ok" as one the
        # worker ended does (which ends it first is a race), never "aborted".
        name, deadline = "sgl_fair_tenant_requests_total", time.monotonic() + 5
        while True:
            metrics = httpx.get(s.url + "/metrics").text
            if metric(metrics, name, outcome="ok") == 19 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert metric(metrics, name, outcome="ok") == 19
        assert metric(metrics, name) == 19
