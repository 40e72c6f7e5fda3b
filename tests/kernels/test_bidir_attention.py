"""Bidirectional paged attention: the torch reference (the spec) and the Triton kernels.

* The spec is checked itself: against dense attention (``scaled_dot_product_attention``) on
  contiguous K/V, and the same tokens stored bidirectionally or all-forward give one answer.
* The Triton kernels match the spec on random BROS-like layouts (``bidirectional_pieces``:
  mixed directions, blocks shared by an RT and a BE sequence, partial blocks, a cached prefix
  followed by a request's own piece at a non-zero offset, lengths 1 and exactly a block).
  On CPU they run in Triton's interpreter, which is chosen when triton is first imported; so
  they run in one subprocess with ``TRITON_INTERPRET=1`` (this file run as a script) and the
  interpreter never leaks into the rest of the suite. On a GPU (``gpu`` mark) they run compiled.

Tolerance: max |kernel - reference| over the outputs (both in the input dtype), ``TOL``.
Skipped without torch or triton, unless ``SGLFAIR_REQUIRE_SGLANG=1`` (CI), where that fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from requires import require

require("torch", "triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sgl_fair.kernels.block_table import (  # noqa: E402
    BlockTable,
    bidirectional_pieces,
    forward_pieces,
    write_kv,
)
from sgl_fair.kernels.reference import (  # noqa: E402
    decode_attention_ref,
    extend_attention_ref,
    gather_kv,
)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# fp16/bf16: output rounding alone is up to one ulp apart (0.98e-3 / 7.8e-3 at |x| in [1, 2))
TOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 2e-2}


def seq_lens_for(s: int) -> list[int]:
    return [1, s, 2 * s, s + 1, 37, 5, 70]


def extend_lens_for(s: int) -> list[int]:  # ragged; the first three prefill whole sequences
    return [1, s, 2 * s, 3, 20, 1, 33]


def make_case(case: dict, device: str, seed: int = 0):
    """(q, k_cache, v_cache, table, extend_lens) for a case; q is [B, H, D] or [T, H, D]."""
    s, d, h, hkv = case["S"], case["D"], case["H"], case["Hkv"]
    dtype = DTYPES[case["dtype"]]
    lens = seq_lens_for(s)
    if case.get("forward"):
        pieces, nb = forward_pieces(lens, s)
    else:
        pieces, nb = bidirectional_pieces(lens, s, seed=case["seed"], prefix_len=s // 2 + 3)
    table = BlockTable.from_pieces(pieces, s, device=device)
    g = torch.Generator().manual_seed(seed)
    # two spare blocks of noise: reading a slot no piece names shows up as an error
    k_cache = torch.randn(nb + 2, s, hkv, d, generator=g).to(device=device, dtype=dtype)
    v_cache = torch.randn(nb + 2, s, hkv, d, generator=g).to(device=device, dtype=dtype)
    ext = extend_lens_for(s)
    rows = len(lens) if case["kind"] == "decode" else sum(ext)
    q = torch.randn(rows, h, d, generator=g).to(device=device, dtype=dtype)
    return q, k_cache, v_cache, table, ext


def kernel_error(case: dict, device: str) -> float:
    """Max |kernel - reference| for one case."""
    from sgl_fair.kernels.bidir_attention import decode_attention, extend_attention

    q, kc, vc, table, ext = make_case(case, device)
    if case["kind"] == "decode":
        out = decode_attention(q, kc, vc, table, num_splits=case["splits"])
        ref = decode_attention_ref(q, kc, vc, table)
    else:
        out = extend_attention(q, kc, vc, table, ext, block_m=case["block_m"])
        ref = extend_attention_ref(q, kc, vc, table, ext)
    assert out.dtype == q.dtype and out.shape == q.shape
    return (out.float() - ref.float()).abs().max().item()


def _cases() -> dict[str, dict]:
    shapes = [(16, 64, 2, 1), (32, 128, 2, 2)]  # block size, head dim, query heads, KV heads
    out = {}
    for dtype in DTYPES:
        for i, (s, d, h, hkv) in enumerate(shapes):
            base = {"dtype": dtype, "S": s, "D": d, "H": h, "Hkv": hkv, "seed": i + 1}
            tag = f"{dtype}-S{s}-D{d}-H{h}kv{hkv}"
            out[f"decode-{tag}"] = {**base, "kind": "decode", "splits": 1 + 2 * i}
            out[f"extend-{tag}"] = {**base, "kind": "extend", "block_m": 32 >> i}
    for s, d in [(16, 128), (32, 64)]:  # the other pairings, GQA 4:2, fp16
        base = {"dtype": "fp16", "S": s, "D": d, "H": 4, "Hkv": 2, "seed": 3}
        out[f"decode-fp16-S{s}-D{d}-H4kv2-split2"] = {**base, "kind": "decode", "splits": 2}
        out[f"extend-fp16-S{s}-D{d}-H4kv2"] = {**base, "kind": "extend", "block_m": 16}
    fwd = {"dtype": "fp32", "S": 16, "D": 64, "H": 2, "Hkv": 1, "seed": 0, "forward": True}
    out["decode-all-forward"] = {**fwd, "kind": "decode", "splits": 1}
    out["extend-all-forward"] = {**fwd, "kind": "extend", "block_m": 32}
    return out


CASES = _cases()


# -- the layout generator covers what the kernels must handle --------------------------------


@pytest.mark.parametrize("s", [16, 32])
def test_random_layouts_have_every_feature(s):
    for seed in (1, 2, 3):
        pieces, nb = bidirectional_pieces(seq_lens_for(s), s, seed=seed, prefix_len=s // 2 + 3)
        flat = [p for row in pieces for p in row]
        sides = {}
        for i, row in enumerate(pieces):
            for blk, direction, _, _ in row:
                sides.setdefault(blk, set()).add((i, direction))
        assert {p[1] for p in flat} == {0, 1}, "mixed directions"
        assert any(
            {i for i, d in v if d == 0} - {i for i, d in v if d == 1}
            for v in sides.values()
            if {d for _, d in v} == {0, 1}
        ), "a block an RT sequence reads from the left and another (BE) from the right"
        assert any(p[2] > 0 for p in flat), "a piece at a non-zero offset"
        assert any(p[3] == s for p in flat) and any(p[3] < s for p in flat), "full and partial"
        assert [sum(p[3] for p in row) for row in pieces] == seq_lens_for(s)
        for blk in range(nb):  # no slot is used twice (CACHE pieces are shared by reference)
            used = set()
            for p in {p for p in flat if p[0] == blk}:
                slots = {o if p[1] == 0 else s - 1 - o for o in range(p[2], p[2] + p[3])}
                assert not used & slots
                used |= slots


def test_slot_indices_follow_the_direction_bit():
    # block 5 of 8 slots: C0 C1 r0 r1 . b2 b1 b0 (kernels/block_table.py's picture)
    table = BlockTable.from_pieces([[(5, 0, 0, 2), (5, 0, 2, 2)], [(5, 1, 0, 3)]], 8)
    assert table.slot_indices(0).tolist() == [40, 41, 42, 43]
    assert table.slot_indices(1).tolist() == [47, 46, 45]
    assert table.seq_lens.tolist() == [4, 3] and table.num_pieces.tolist() == [2, 1]
    with pytest.raises(ValueError):
        BlockTable.from_pieces([[(0, 1, 6, 3)]], 8)  # does not fit the block


def test_write_kv_then_gather_round_trips():
    s = 16
    pieces, nb = bidirectional_pieces(seq_lens_for(s), s, seed=2, prefix_len=s // 2 + 3)
    table = BlockTable.from_pieces(pieces, s)
    kc, vc = torch.zeros(nb, s, 2, 8), torch.zeros(nb, s, 2, 8)
    for b in (0, 2, 4):  # sequences that do not share the cached prefix
        n = int(table.seq_lens[b])
        k, v = torch.randn(n, 2, 8), torch.randn(n, 2, 8)
        write_kv(kc, vc, table.slot_indices(b), k, v)
        gk, gv = gather_kv(kc, vc, table, b)
        assert torch.equal(gk, k) and torch.equal(gv, v)


# -- the spec --------------------------------------------------------------------------------


def _dense(q, k, v, causal_from=None):
    """q [M, H, D], k/v [N, Hkv, D] contiguous -> [M, H, D] via SDPA in float64."""
    group = q.shape[1] // k.shape[1]
    qq = q.double().transpose(0, 1)
    kk = k.double().repeat_interleave(group, 1).transpose(0, 1)
    vv = v.double().repeat_interleave(group, 1).transpose(0, 1)
    mask = None
    if causal_from is not None:
        qpos = causal_from + torch.arange(q.shape[0])[:, None]
        mask = torch.arange(k.shape[0])[None, :] <= qpos
    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask).transpose(0, 1)


@pytest.mark.parametrize("hkv", [1, 2])
def test_reference_matches_dense_attention(hkv):
    torch.manual_seed(0)
    s, h, d = 16, 4, 32
    lens, ext = seq_lens_for(s), extend_lens_for(s)
    pieces, nb = bidirectional_pieces(lens, s, seed=1, prefix_len=s // 2 + 3)
    table = BlockTable.from_pieces(pieces, s)
    kc, vc = torch.randn(nb, s, hkv, d), torch.randn(nb, s, hkv, d)
    qd, qe = torch.randn(len(lens), h, d), torch.randn(sum(ext), h, d)
    dec = decode_attention_ref(qd, kc, vc, table)
    exo = extend_attention_ref(qe, kc, vc, table, ext)
    start = 0
    for b, n in enumerate(lens):
        k, v = gather_kv(kc, vc, table, b)  # contiguous, logical order
        want = _dense(qd[b : b + 1], k, v)[0]
        assert (dec[b] - want).abs().max() <= 1e-5
        rows = slice(start, start + ext[b])
        want = _dense(qe[rows], k, v, causal_from=n - ext[b])
        assert (exo[rows] - want).abs().max() <= 1e-5
        start += ext[b]


def test_reference_same_tokens_bidirectional_or_forward():
    torch.manual_seed(1)
    s, h, hkv, d = 16, 2, 1, 64
    lens, ext = seq_lens_for(s), extend_lens_for(s)
    bi_pieces, nb = bidirectional_pieces(lens, s, seed=3, prefix_len=s // 2 + 3)
    bi = BlockTable.from_pieces(bi_pieces, s)
    fw_pieces, nf = forward_pieces(lens, s)
    fw = BlockTable.from_pieces(fw_pieces, s)
    bk, bv = torch.randn(nb, s, hkv, d), torch.randn(nb, s, hkv, d)
    fk, fv = torch.zeros(nf, s, hkv, d), torch.zeros(nf, s, hkv, d)
    for b in range(len(lens)):
        k, v = gather_kv(bk, bv, bi, b)
        write_kv(fk, fv, fw.slot_indices(b), k, v)
    qd, qe = torch.randn(len(lens), h, d), torch.randn(sum(ext), h, d)
    assert torch.allclose(
        decode_attention_ref(qd, bk, bv, bi), decode_attention_ref(qd, fk, fv, fw), atol=1e-6
    )
    assert torch.allclose(
        extend_attention_ref(qe, bk, bv, bi, ext),
        extend_attention_ref(qe, fk, fv, fw, ext),
        atol=1e-6,
    )


# -- the Triton kernels ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreted_errors() -> dict:
    """Every case's error, from one interpreter subprocess (this file run as a script)."""
    tests = str(Path(__file__).resolve().parents[1])  # for ``requires`` in the script
    path = os.pathsep.join(x for x in (tests, os.environ.get("PYTHONPATH")) if x)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, __file__],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cid", list(CASES))
def test_kernel_matches_reference_interpreted(cid, interpreted_errors):
    err = interpreted_errors[cid]
    assert isinstance(err, float), err  # else: the case's traceback
    assert err <= TOL[CASES[cid]["dtype"]], f"{cid}: max abs error {err:.3g}"


@pytest.mark.gpu
def test_kernel_matches_reference_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    errors = {cid: kernel_error(case, "cuda") for cid, case in CASES.items()}
    bad = {cid: e for cid, e in errors.items() if e > TOL[CASES[cid]["dtype"]]}
    assert not bad, bad


def main() -> None:
    """Run every case (CPU, interpreter) and print ``{case id: max abs error | traceback}``."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the kernels run on CPU in the interpreter)")
    results = {}
    for cid, case in CASES.items():
        try:
            results[cid] = kernel_error(case, "cpu")
        except Exception:  # reported per case by the test
            results[cid] = traceback.format_exc()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
