"""On a GPU: ``launch --backend sglang`` starts real SGLang 0.5.23 servers behind our router.

A tiny Llama (2 layers, hidden 256, random weights via ``--load-format dummy``, a byte-level
tokenizer built here) keeps start-up to model-free seconds: nothing is downloaded. Requests go
HTTP -> router -> bridge -> SGLang (our plugin on its scheduler), and the router follows each
server's KV events. Skipped where no GPU is visible (``tests/conftest.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))  # live_helpers
from live_helpers import launched  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

VOCAB_SIZE = 512
SPECIALS = ["<s>", "</s>", "<unk>"]


def make_tiny_llama(root: Path) -> Path:
    """A model directory SGLang and our router both load: config.json for a 2-layer
    LlamaForCausalLM and a byte-level tokenizer with exactly ``VOCAB_SIZE`` tokens (the model
    may emit any id below it, and every one must decode)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    pairs = (a + b for a in alphabet for b in alphabet)
    merges = []
    while len(vocab) < VOCAB_SIZE:  # two-byte tokens, with the merges that make them
        pair = next(pairs)
        vocab[pair] = len(vocab)
        merges.append((pair[0], pair[1]))
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE

    d = root / "tiny-llama"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 2048,
            }
        )
    )
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "head_dim": 64,
                "hidden_act": "silu",
                "max_position_embeddings": 2048,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "vocab_size": VOCAB_SIZE,
                "bos_token_id": 0,
                "eos_token_id": 1,
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
            }
        )
    )
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    return d


def num_gpus() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([x for x in visible.split(",") if x.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def gpu_pids() -> set[int]:
    """Processes holding GPU memory now."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return {int(x) for x in out.stdout.split() if x.strip().isdigit()}


def _procs_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def test_sglang_servers_behind_the_router(tmp_path):
    model = make_tiny_llama(tmp_path)
    dp = 2 if num_gpus() >= 2 else 1  # one server per GPU
    gpu_before = gpu_pids()
    args = ["--backend", "sglang", "--model-path", str(model), "--dp", str(dp)]
    args += ["--load-format", "dummy", "--mem-fraction-static", "0.3"]  # passed through
    args += ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    with launched(*args, tmp_path=tmp_path, timeout_s=900) as s:
        info = s.info()
        assert info["backend"] == "sglang" and info["dp_size"] == dp
        for w in info["workers"]:
            assert w["alive"] and w["engine"].startswith("sglang 0.5.23"), w
            assert w["kv_capacity_tokens"] > 0  # the server's max_total_num_tokens
        assert info["context_length"] <= 2048

        shared = list(range(10, 200))  # a shared prefix the servers cache and report
        for i, client in enumerate(["alice", "bob", "alice", "carol"]):
            body = {
                "input_ids": [*shared, 300 + i],
                "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
            }
            r = httpx.post(
                s.url + "/generate", json=body, headers={"X-Client-Id": client}, timeout=120
            )
            assert r.status_code == 200, r.text
            out = r.json()
            assert len(out["output_ids"]) == 8 and max(out["output_ids"]) < VOCAB_SIZE
            assert out["meta_info"]["finish_reason"]["type"] == "length"

        with httpx.stream(
            "POST",
            s.url + "/generate",
            json={"text": "hello there", "stream": True,
                  "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}},
            timeout=120,
        ) as resp:  # fmt: skip
            lines = [x for x in resp.iter_lines() if x.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][len("data: ") :])
        assert len(last["output_ids"]) == 6

        # The servers' KV events reached the router's tree.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            workers = s.info()["workers"]
            if sum(w["kv_events"] for w in workers) > 0:
                break
            time.sleep(0.2)
        assert sum(w["kv_events"] for w in workers) > 0, workers
        assert all(w["kv_event_gaps"] == 0 for w in workers)
        assert any(w["tree_tokens"] >= len(shared) for w in workers), workers

        # A client that hangs up is aborted on the server.
        async def hang_up() -> None:
            async with (
                httpx.AsyncClient(timeout=120) as client,
                client.stream(
                    "POST", s.url + "/generate",
                    json={"text": "long", "stream": True,
                          "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}},
                ) as resp,
            ):  # fmt: skip
                async for _line in resp.aiter_lines():
                    break

        asyncio.run(hang_up())
        deadline = time.monotonic() + 30
        while s.info()["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert s.info()["in_flight"] == 0

        # Idle now: flushing empties the servers' caches, and their events the router's tree.
        # (SGLang refuses while anything runs, its own /health generation included: retry.)
        for _ in range(10):
            r = httpx.post(s.url + "/flush_cache", timeout=60)
            if r.status_code == 200:
                break
            time.sleep(1.0)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(w["tree_tokens"] == 0 for w in s.info()["workers"]):
                break
            time.sleep(0.2)
        assert all(w["tree_tokens"] == 0 for w in s.info()["workers"])
    # The launcher stopped its SGLang servers (and their schedulers) on the way out.
    deadline = time.monotonic() + 30
    while _procs_mentioning(str(model)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _procs_mentioning(str(model)), "SGLang processes outlived the launcher"
    while gpu_pids() - gpu_before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not gpu_pids() - gpu_before, "SGLang's schedulers still hold the GPU"
