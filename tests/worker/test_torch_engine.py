"""The torch engine: a real (tiny, random) Llama model behind the ``Engine`` protocol.

* The model: shapes, RoPE (a position shift changes q/k; relative positions are what count),
  GQA (KV heads shared by query-head groups), checkpoints round-trip through safetensors.
* Exactness (float64, greedy): requests run in ragged batches — prefill chunks split at odd
  places, decodes interleaved, KV slots scattered over blocks, some runs falling inside a
  block — produce exactly the tokens of greedy generation with ``forward_full`` (the whole
  sequence recomputed, no cache) token by token.
* ``kv_copies`` move tensors: checkpoint to host, clobber the device slots, restore, and the
  outputs are unchanged.
* The Triton path (interpreter, in a subprocess: this file run as a script) matches the
  reference path.
* Temperature sampling is a function of the seed and position, not of the batching.

Skipped without torch, unless ``SGLFAIR_REQUIRE_SGLANG=1`` (CI), where that fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from requires import require

require("torch")

import torch  # noqa: E402

from sgl_fair.kernels.block_table import pieces_from_slots  # noqa: E402
from sgl_fair.request import Request  # noqa: E402
from sgl_fair.worker.engine import Batch, KVCopy, PrefillChunk  # noqa: E402
from sgl_fair.worker.torch_engine.engine import TorchEngine  # noqa: E402
from sgl_fair.worker.torch_engine.model import LlamaConfig, LlamaModel  # noqa: E402

BLOCK = 16
NUM_BLOCKS = 48


def tiny(dtype=torch.float64, **kw) -> LlamaModel:
    return LlamaModel.random(LlamaConfig.preset("tiny", **kw), seed=0, dtype=dtype)


class SlotBook:
    """A toy allocator: each request fills half-blocks picked at random, a block's left half
    from the left (rising slots), its right half from the right (falling slots), as BROS
    shares a block between an RT and a BE request; a sequence's slots are scattered."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.free = [(b, side) for b in range(num_blocks) for side in (0, 1)]
        self.rng.shuffle(self.free)
        self.bs = block_size
        self.slots: dict[str, list[int]] = {}
        self.cur: dict[str, list[int]] = {}  # rid -> slots left in its current block, in order

    def grow(self, rid: str, n: int) -> None:
        have = self.slots.setdefault(rid, [])
        while len(have) < n:
            left = self.cur.get(rid)
            if not left:
                b, side = self.free.pop()
                half = self.bs // 2
                run = [b * self.bs + side * half + i for i in range(half)]
                left = run[::-1] if side else run
                self.cur[rid] = left
            have.append(left.pop(0))

    def __call__(self, req: Request) -> list[int]:
        return self.slots[req.rid]


def make_requests(n: int, out_len: int, seed: int = 1, **sampling) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(3, 32000) for _ in range(rng.randrange(5, 40))]
        reqs.append(Request(f"r{i}", "c", prompt, out_len, 0.0, sampling=dict(sampling) or None))
    return reqs


def drive(engine: TorchEngine, book: SlotBook, reqs: list[Request], seed: int = 2, hook=None):
    """Run ``reqs`` to the end in random ragged batches (what a scheduler would send)."""
    rng = random.Random(seed)
    step = 0
    while not all(r.done for r in reqs):
        prefill, decode = [], []
        for r in reqs:
            if r.done or rng.random() < 0.25:  # sit this step out sometimes
                continue
            if r.num_computed < r.input_len:
                n = rng.randint(1, r.input_len - r.num_computed)
                last = r.num_computed + n == r.input_len
                prefill.append(PrefillChunk(r, r.num_computed, n, last))
                book.grow(r.rid, r.num_computed + n)
            else:
                decode.append(r)
                book.grow(r.rid, r.seq_len)
        if not prefill and not decode:
            continue
        batch = Batch(prefill=tuple(prefill), decode=tuple(decode))
        if hook is not None:
            batch = hook(step, batch) or batch
        result = engine.run(batch)
        toks = iter(result.next_token_ids)
        for c in batch.prefill:
            c.req.num_computed += c.num_tokens
            if c.last:
                c.req.output_ids.append(next(toks))
        for r in batch.decode:
            r.num_computed += 1
            r.output_ids.append(next(toks))
        step += 1
    return step


def greedy_full(model: LlamaModel, prompt, n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(torch.argmax(model.forward_full(ids)[-1])))
    return ids[len(prompt) :]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the tensors are tiny, and spinning threads on shared cores cost
    several times the work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model64() -> LlamaModel:
    return tiny()


def new_engine(model, book, **kw) -> TorchEngine:
    return TorchEngine(
        model, kv_slots=book, num_device_slots=NUM_BLOCKS * BLOCK, block_size=BLOCK, **kw
    )


# ---- the model --------------------------------------------------------------------------------


def test_model_shapes_rope_and_gqa(model64):
    cfg = model64.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim) == (2, 256, 4, 64)
    assert (cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size) == (2, 688, 32000)
    logits = model64.forward_full([5, 6, 7, 8])
    assert logits.shape == (4, 32000) and logits.dtype == torch.float64
    assert logits[-1].std() > 1.0  # a peaked distribution, not a flat one
    layer = model64.layers[0]
    x = model64.embed(torch.tensor([11, 12, 13]))
    cos, sin = model64.rope(torch.arange(3))
    q, k, v = layer.qkv(x, cos, sin)
    assert q.shape == (3, 4, 64) and k.shape == v.shape == (3, 2, 64)
    # position 0 is unrotated; RoPE preserves norms; scores depend on relative positions only
    q0, k0, _ = layer.qkv(x, *model64.rope(torch.zeros(3, dtype=torch.long)))
    assert torch.allclose(q0[0], q[0]) and not torch.allclose(q0[1], q[1])
    assert torch.allclose(q.norm(dim=-1), q0.norm(dim=-1))
    q7, k7, _ = layer.qkv(x, *model64.rope(torch.arange(7, 10)))
    s3 = torch.einsum("hd,hd->h", q[2, ::2], k[0])  # heads 0, 2 read KV heads 0, 1
    s3b = torch.einsum("hd,hd->h", q7[2, ::2], k7[0])
    assert torch.allclose(s3, s3b)
    # GQA: query heads 0 and 1 share KV head 0 — dropping KV head 1 changes heads 2, 3 only
    from sgl_fair.worker.torch_engine.model import dense_attention

    full = dense_attention(q, k, v, None)
    k2, v2 = k.clone(), v.clone()
    k2[:, 1], v2[:, 1] = 0.0, 0.0
    part = dense_attention(q, k2, v2, None)
    assert torch.equal(full[:, :2], part[:, :2]) and not torch.allclose(full[:, 2:], part[:, 2:])


def test_launcher_knows_the_presets():
    from sgl_fair.launch.config import TORCH_PRESETS
    from sgl_fair.worker.torch_engine.model import PRESETS

    assert set(TORCH_PRESETS) == set(PRESETS)
    from sgl_fair.launch.config import parse_config

    cfg = parse_config(["--backend", "torch", "--dp", "2"])
    assert (cfg.backend, cfg.model, cfg.torch_attention) == ("torch", "tiny", "reference")
    assert parse_config([]).model == "Llama-3.1-8B"  # the simulator's default is unchanged
    with pytest.raises(SystemExit):
        parse_config(["--backend", "torch", "--model", "no-such-model"])


def test_checkpoint_round_trip(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    model = tiny(torch.float32, vocab_size=300)
    cfg = model.config
    state = {k: t.contiguous() for k, t in model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    hf = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        intermediate_size=cfg.intermediate_size, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, rope_theta=cfg.rope_theta, eos_token_id=2,
        max_position_embeddings=cfg.max_position, rms_norm_eps=cfg.rms_norm_eps,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hf))
    loaded = LlamaModel.from_pretrained(tmp_path)
    assert loaded.config.eos_token_id == 2
    ids = [1, 50, 299, 7]
    assert torch.equal(loaded.forward_full(ids), model.forward_full(ids))


def test_pieces_from_slots_inverts_slot_indices():
    from sgl_fair.kernels.block_table import BlockTable

    s = 8
    slots = [40, 41, 42, 43, 72, 47, 46, 45, 9, 3, 2, 1, 0, 31]
    pieces = pieces_from_slots(slots, s)
    assert pieces == [
        (5, 0, 0, 4), (9, 0, 0, 1), (5, 1, 0, 3), (1, 0, 1, 1), (0, 1, 4, 4), (3, 0, 7, 1),
    ]  # fmt: skip
    table = BlockTable.from_pieces([pieces], s)
    assert table.slot_indices(0).tolist() == slots
    assert pieces_from_slots([], s) == []


# ---- the engine: exactness --------------------------------------------------------------------


def test_ragged_batches_equal_greedy_full_recompute(model64):
    reqs = make_requests(5, out_len=6, temperature=0)
    book = SlotBook(NUM_BLOCKS, BLOCK, seed=3)
    engine = new_engine(model64, book)
    steps = drive(engine, book, reqs)
    assert steps >= 8
    runs = [pieces_from_slots(book.slots[r.rid], BLOCK) for r in reqs]
    assert any(p[1] == 1 and p[3] > 1 for run in runs for p in run)  # falling runs exercised
    assert sum(len(run) for run in runs) > 2 * len(reqs)  # scattered over blocks
    for r in reqs:
        assert r.output_ids == greedy_full(model64, r.input_ids, 6), r.rid


def test_kv_copies_move_tensors(model64):
    reqs = make_requests(3, out_len=5, seed=4, temperature=0)
    book = SlotBook(NUM_BLOCKS, BLOCK, seed=5)
    engine = TorchEngine(
        model64, kv_slots=book, num_device_slots=NUM_BLOCKS * BLOCK, block_size=BLOCK,
        host_slots=4 * BLOCK,
    )  # fmt: skip
    victim = reqs[0]
    saved = {}

    def hook(step: int, batch: Batch):
        if victim.num_output != 2 or "ops" in saved or victim.done:
            return None
        # checkpoint every slot victim holds (all computed), one KVCopy per run in a block
        slots = book.slots[victim.rid][: victim.num_computed]
        ops, host = [], 0
        for block, direction, offset, length in pieces_from_slots(slots, BLOCK):
            lo = offset if direction == 0 else BLOCK - offset - length
            ops.append((block, lo, length, host))
            host += length
        assert host <= 4 * BLOCK
        saved["ops"] = ops
        saved["k"] = engine.k[:, slots].clone()
        saved["dev"] = [
            engine.k[:, b * BLOCK + lo : b * BLOCK + lo + n].clone() for b, lo, n, _ in ops
        ]
        out = [KVCopy(True, h, b, lo, n) for b, lo, n, h in ops]
        return Batch(batch.prefill, batch.decode, kv_copies=tuple(out))

    def hook2(step: int, batch: Batch):
        out = hook(step, batch)
        if out is not None:
            return out
        if "ops" in saved and "restored" not in saved:
            slots = book.slots[victim.rid][: len(saved["k"][0])]
            engine.k[:, slots] = torch.randn_like(saved["k"])  # clobber, as another owner would
            engine.v[:, slots] = 7.0
            saved["restored"] = True
            restore = [KVCopy(False, h, b, lo, n) for b, lo, n, h in saved["ops"]]
            return Batch(batch.prefill, batch.decode, kv_copies=tuple(restore))
        return None

    drive(engine, book, reqs, seed=6, hook=hook2)
    assert saved.get("restored")
    for (_, _, n, h), dev in zip(saved["ops"], saved["dev"], strict=True):
        assert torch.equal(engine.k_host[:, h : h + n], dev)  # the checkpoint really happened
    for r in reqs:
        assert r.output_ids == greedy_full(model64, r.input_ids, 5), r.rid


# ---- sampling ---------------------------------------------------------------------------------


def test_temperature_sampling_is_deterministic_per_seed():
    model = tiny(torch.float32, vocab_size=512)
    outs = []
    for batching_seed, sampling_seed in ((2, 7), (9, 7), (2, 8)):
        reqs = make_requests(3, out_len=8, seed=10, temperature=1.5, top_p=0.95,
                             top_k=50, sampling_seed=sampling_seed)  # fmt: skip
        for r in reqs:
            r.input_ids = tuple(t % 512 for t in r.input_ids)
        book = SlotBook(NUM_BLOCKS, BLOCK, seed=batching_seed)
        drive(new_engine(model, book), book, reqs, seed=batching_seed)
        outs.append([r.output_ids for r in reqs])
    assert outs[0] == outs[1]  # same seed, other batching and slots: same tokens
    assert outs[0] != outs[2]  # another seed: other tokens
    greedy = [greedy_full(model, r.input_ids, 8) for r in reqs]
    assert outs[0] != greedy  # it really sampled


def test_eos_ends_the_request_unless_ignore_eos():
    model = tiny(torch.float32, vocab_size=512)
    (probe,) = make_requests(1, out_len=4, seed=12, temperature=0)
    probe.input_ids = tuple(t % 512 for t in probe.input_ids)
    first = greedy_full(model, probe.input_ids, 1)[0]
    for ignore, want in ((False, 1), (True, 4)):
        req = Request("e", "c", probe.input_ids, 4, 0.0,
                      sampling={"temperature": 0, "ignore_eos": ignore})  # fmt: skip
        book = SlotBook(NUM_BLOCKS, BLOCK)
        engine = new_engine(model, book, eos_token_id=first)
        drive(engine, book, [req])
        assert req.num_output == want and req.output_ids[0] == first


def test_logprobs_match_forward_full(model64):
    (req,) = make_requests(1, out_len=3, seed=13, temperature=0)
    req.logprob_start_len, req.top_logprobs_num = 2, 3
    book = SlotBook(NUM_BLOCKS, BLOCK)
    engine = new_engine(model64, book)
    drive(engine, book, [req])
    lp = engine.logprobs(req)
    assert len(lp.input) == req.input_len - 2 and len(lp.output) == 3
    assert all(row[0][1] == t for row, t in zip(lp.output_top, req.output_ids, strict=True))
    assert all(abs(row[0][0] - o) < 1e-12 for row, o in zip(lp.output_top, lp.output, strict=True))


# ---- the Triton path (interpreter subprocess) -------------------------------------------------


def triton_case() -> dict:
    """Reference vs Triton attention on one small ragged run (float32); the errors."""
    model = tiny(torch.float32, vocab_size=512)
    results = {}
    for attention in ("reference", "triton"):
        reqs = make_requests(3, out_len=3, seed=14, temperature=0)
        for r in reqs:
            r.input_ids = tuple(t % 512 for t in r.input_ids[:20])
        book = SlotBook(NUM_BLOCKS, BLOCK, seed=15)
        engine = new_engine(model, book, attention=attention)
        drive(engine, book, reqs, seed=16)
        results[attention] = (engine, [r.output_ids for r in reqs])
    (ref, ref_out), (tri, tri_out) = results["reference"], results["triton"]
    return {
        "same_tokens": ref_out == tri_out,
        "k_err": float((ref.k - tri.k).abs().max()),
        "v_err": float((ref.v - tri.v).abs().max()),
    }


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_attention_matches_reference_interpreted():
    tests = str(Path(__file__).resolve().parents[1])  # for ``requires`` in the script
    path = os.pathsep.join(x for x in (tests, os.environ.get("PYTHONPATH")) if x)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, str(Path(__file__))], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["same_tokens"], res
    assert res["k_err"] < 1e-4 and res["v_err"] < 1e-4, res


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(triton_case()))
