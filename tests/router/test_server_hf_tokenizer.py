"""``--model-path DIR`` with a Hugging Face tokenizer: the live server tokenizes and renders
chats with it, and the simulated engine's outputs decode with it."""

from __future__ import annotations

import httpx
import pytest
from live_helpers import launched
from test_tokenizer import make_hf_dir

from sgl_fair.launch.serve import text_model
from sgl_fair.router.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow


def test_launch_with_a_local_hf_tokenizer(tmp_path):
    model_dir = make_hf_dir(tmp_path)
    tok = load_tokenizer(str(model_dir))
    with launched("--dp", "1", "--model-path", str(model_dir), tmp_path=tmp_path) as s:
        mi = httpx.get(s.url + "/get_model_info", timeout=10).json()
        assert mi["model_path"] == str(model_dir)
        prompt = "the quick brown fox"
        # Simulated output is a pure function of the request id: pick one whose six tokens
        # include a paragraph break ("\n"), an id outside this vocabulary's word range.
        tm = text_model(tok)
        rid = next(
            f"hf-{i}"
            for i in range(10_000)
            if tm.newline_id in [tm.mark_id(f"hf-{i}", p) for p in range(6)]
        )
        r = httpx.post(
            s.url + "/generate",
            json={"text": prompt, "rid": rid, "sampling_params": {"max_new_tokens": 6}},
            timeout=30,
        ).json()
        assert r["meta_info"]["prompt_tokens"] == len(tok.encode(prompt))
        # Words come from the clean range; punctuation (".", ",", "\n") is the tokenizer's
        # own ids, which may lie outside it (this vocabulary's "\n" does); EOS ends a
        # request that stops on its own.
        lo, hi = tok.output_token_range
        marks = {m for m in (tm.period_id, tm.comma_id, tm.newline_id) if m is not None}
        ids = r["output_ids"]
        assert all(lo <= t < hi or t in marks for t in ids[:-1])
        assert lo <= ids[-1] < hi or ids[-1] in marks or ids[-1] in tok.eos_token_ids
        assert r["text"] == tok.decode(ids) and tm.newline_id in ids and "\n" in r["text"]
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
