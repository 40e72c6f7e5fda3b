"""``--model-path DIR`` with a Hugging Face tokenizer: the live server tokenizes and renders
chats with it, and the simulated engine's outputs decode with it."""

from __future__ import annotations

import httpx
import pytest
from live_helpers import launched
from test_tokenizer import make_hf_dir

from sgl_fair.router.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow


def test_launch_with_a_local_hf_tokenizer(tmp_path):
    model_dir = make_hf_dir(tmp_path)
    tok = load_tokenizer(str(model_dir))
    with launched("--dp", "1", "--model-path", str(model_dir), tmp_path=tmp_path) as s:
        mi = httpx.get(s.url + "/get_model_info", timeout=10).json()
        assert mi["model_path"] == str(model_dir)
        prompt = "the quick brown fox"
        r = httpx.post(
            s.url + "/generate",
            json={"text": prompt, "sampling_params": {"max_new_tokens": 6}},
            timeout=30,
        ).json()
        assert r["meta_info"]["prompt_tokens"] == len(tok.encode(prompt))
        lo, hi = tok.output_token_range
        assert all(lo <= t < hi for t in r["output_ids"])
        assert r["text"] == tok.decode(r["output_ids"])
        chat = httpx.post(
            s.url + "/v1/chat/completions",
            json={
                "model": str(model_dir),
                "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 4,
            },
            timeout=30,
        ).json()
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": "hello there"}], add_generation_prompt=True
        )
        expected = len(tok.encode(rendered, add_special_tokens=False))
        assert chat["usage"]["prompt_tokens"] == expected
        # A template that refuses the conversation is a 400 on `messages`.
        bad = httpx.post(
            s.url + "/v1/chat/completions",
            json={"model": str(model_dir), "messages": [{"role": "tool", "content": "x"}]},
            timeout=30,
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    missing = ("--dp", "1", "--model-path", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="model-path"), launched(*missing, tmp_path=tmp_path):
        pass
