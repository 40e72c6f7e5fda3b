"""``python -m sgl_fair.launch --dp 2 --backend torch --model tiny``: a real (tiny, random)
model behind the HTTP API. ``/generate`` and ``/v1/chat/completions`` answer with the model's
tokens: greedy output equals greedy generation with ``forward_full`` of the same model (the
tiny preset's weights come from a fixed seed, its vocabulary sized to the tokenizer's).

Skipped without torch (unless ``SGLFAIR_REQUIRE_SGLANG=1``, where that fails).
"""

from __future__ import annotations

import httpx
import openai
import pytest
from live_helpers import launched
from requires import require

require("torch")

pytestmark = pytest.mark.slow

ARGS = ("--dp", "2", "--backend", "torch", "--model", "tiny", "--kv-tokens", "4096")


def greedy_full(prompt: list[int], n: int, eos: int = 2) -> list[int]:
    import torch

    from sgl_fair.worker.torch_engine.model import LlamaConfig, LlamaModel

    torch.set_num_threads(1)
    model = LlamaModel.random(LlamaConfig.preset("tiny", vocab_size=32000), seed=0)
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(torch.argmax(model.forward_full(ids)[-1])))
        if ids[-1] == eos:
            break
    return ids[len(prompt) :]


def test_generate_and_chat_with_the_tiny_model(tmp_path):
    with launched(*ARGS, tmp_path=tmp_path, timeout_s=120) as s:
        prompt = [1, 450, 4996, 17354, 1701, 29916, 432, 17204]
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        outs = [httpx.post(s.url + "/generate", json=body, timeout=60) for _ in range(3)]
        for r in outs:
            assert r.status_code == 200, r.text
        ids = [r.json()["output_ids"] for r in outs]
        assert ids[0] == ids[1] == ids[2] == greedy_full(prompt, 8)
        meta = outs[0].json()["meta_info"]
        assert meta["completion_tokens"] == len(ids[0]) and meta["prompt_tokens"] == len(prompt)

        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none")
        chat = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hello there"}],
            max_tokens=6, temperature=0.7, seed=3,
        )  # fmt: skip
        assert chat.choices[0].finish_reason in ("length", "stop")
        assert 1 <= chat.usage.completion_tokens <= 6
        info = s.info()
        assert "torch tiny" in str(info)
