"""``make demo-bros``, shortened: the demo's traffic through a live BROS server."""

from __future__ import annotations

import asyncio

import pytest

from sgl_fair.demo import bros
from sgl_fair.demo.server import serving


def test_prompts_have_the_stated_lengths_and_share_no_prefix():
    a, b = bros.prompt_ids(1, bros.RT_PROMPT), bros.prompt_ids(2, bros.RT_PROMPT)
    assert len(a) == len(b) == bros.RT_PROMPT and a[0] != b[0]
    assert bros.prompt_ids(1, 5) == a[:5]  # a pure function of the request number
    # RT request i and BE request j (numbered -1 - j, as the demo sends them) share nothing:
    # before, an int seed lost its sign, and RT 1's prompt was BE 0's first 200 tokens.
    rt = {tuple(bros.prompt_ids(i, 4)) for i in range(64)}
    be = {tuple(bros.prompt_ids(-1 - j, 4)) for j in range(64)}
    assert len(rt) == len(be) == 64 and not rt & be


@pytest.mark.slow
def test_the_demo_runs_live_with_the_stated_prompt_lengths(tmp_path):
    args = ["--dp", "1", "--gpu", bros.GPU, "--model", bros.MODEL, "--tp", bros.TP,
            "--schedule-policy", "bros"]  # fmt: skip
    with serving(args, tmp_path / "server.log") as url:
        result = asyncio.run(bros.drive(url, rate=4.0, calm_s=1.0, busy_s=3.0, seed=0))
    rows = result["rows"]
    assert rows and not [r for r in rows if "error" in r]
    assert {r["prompt_tokens"] for r in rows} == {bros.RT_PROMPT}
    assert {r["phase"] for r in rows} == {"calm", "busy"}
    assert result["be_tok_s"] > 0  # the batch job ran beside the chat
    summary = bros.summarize(result)
    assert summary["busy"]["requests"] + summary["calm"]["requests"] == len(rows)
