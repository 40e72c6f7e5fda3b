"""The torch engine: a real model behind the ``Engine`` protocol, KV in flat slot pools.

Per layer, K and V live in one pool each, ``[num_device_slots, kv_heads, head_dim]``, addressed
by flat slot ``block * block_size + slot`` — the allocator's slots, which the scheduler hands
over per request (``kv_slots(req)``: the flat slot of each position of ``req.all_ids()``, in
logical order). Host buffers ``[host_slots, kv_heads, head_dim]`` hold checkpointed KV (the
bidirectional allocator's ``KVCopy`` ops). A step::

    do batch.kv_copies, in order           (device <-> host, all layers)
    one forward over the batch's tokens    (prefill chunks and decode tokens, ragged)
      per layer: q, k, v -> write k, v at each new token's slot -> attention per sequence over
                 its slots [0, position] (causal) -> o_proj, MLP
    sample one token per last prefill chunk and per decode request

Attention is ``"reference"`` (gather by flat slot, plain softmax; exact) or ``"triton"`` (the
paged kernels of ``sgl_fair.kernels.bidir_attention`` over each sequence's pieces, built from
its slots with ``pieces_from_slots``; CUDA, or CPU under ``TRITON_INTERPRET=1``).

Sampling follows SGLang's parameters: ``temperature == 0`` is greedy; else temperature, then
top-k, then top-p, drawn with a generator seeded from ``sampling_seed`` (or the rid) and the
output position, so a request samples the same tokens however it is batched. Sampling EOS (or
one of ``stop_token_ids``) ends the request unless ``ignore_eos``: the engine lowers the
request's ``output_len`` to the token it just produced, which the scheduler's ``done`` reads.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sgl_fair.request import Request
from sgl_fair.worker.engine import Batch, KVCopy, Logprobs, StepResult
from sgl_fair.worker.torch_engine.model import LlamaModel, dense_attention

SlotFn = Callable[[Request], Sequence[int]]


@dataclass(frozen=True)
class _Seq:
    """One sequence's part of a step: positions [start, start + n), its first T row."""

    req: Request
    start: int
    n: int
    row: int
    slots: torch.Tensor  # flat slots of positions 0 .. start + n - 1 (int64, on device)
    decode: bool
    sample: bool  # the last row samples this request's next token


class TorchEngine:
    synchronous = True  # run() returns after the step: its duration has already elapsed

    def __init__(
        self,
        model: LlamaModel,
        *,
        kv_slots: SlotFn,
        num_device_slots: int,
        block_size: int = 1,
        host_slots: int = 0,
        attention: str = "reference",
        eos_token_id: int | None = None,
        vocab_limit: int | None = None,
    ) -> None:
        if attention not in ("reference", "triton"):
            raise ValueError(f"attention must be 'reference' or 'triton' (got {attention!r})")
        if num_device_slots < 1 or num_device_slots % block_size:
            raise ValueError(
                f"num_device_slots {num_device_slots} is not a positive multiple of "
                f"block_size {block_size}"
            )
        self.model = model
        self.kv_slots = kv_slots
        self.block_size = block_size
        self.attention = attention
        cfg = model.config
        self.eos_token_id = eos_token_id if eos_token_id is not None else cfg.eos_token_id
        # sample only ids below this (a tokenizer smaller than the model's embedding)
        self.vocab_limit = min(vocab_limit or cfg.vocab_size, cfg.vocab_size)
        dev, dt = model.device, model.dtype
        shape = (cfg.num_layers, num_device_slots, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dt, device=dev)
        self.v = torch.zeros(shape, dtype=dt, device=dev)
        hshape = (cfg.num_layers, host_slots, cfg.num_kv_heads, cfg.head_dim)
        pin = dev.type == "cuda"
        self.k_host = torch.zeros(hshape, dtype=dt, pin_memory=pin)
        self.v_host = torch.zeros(hshape, dtype=dt, pin_memory=pin)
        self.num_steps = 0
        self.num_tokens = 0
        self.busy_s = 0.0
        self._dec_cache = None

    @property
    def num_device_slots(self) -> int:
        return self.k.shape[1]

    # ---- KV copies --------------------------------------------------------------------------

    def copy_kv(self, op: KVCopy) -> None:
        """One ``KVCopy``: device block ``op.block`` slots [slot, +n) <-> host [offset, +n)."""
        lo = op.block * self.block_size + op.slot
        n = op.num_tokens
        if n <= 0:
            return
        if op.slot + n > self.block_size and self.block_size > 1:
            raise ValueError(f"{op}: runs past its block of {self.block_size} slots")
        dev = slice(lo, lo + n)
        host = slice(op.host_offset, op.host_offset + n)
        if lo + n > self.k.shape[1] or op.host_offset + n > self.k_host.shape[1]:
            raise ValueError(f"{op}: out of range (device {self.k.shape[1]}, host "
                             f"{self.k_host.shape[1]} slots)")  # fmt: skip
        if op.to_host:
            self.k_host[:, host].copy_(self.k[:, dev], non_blocking=False)
            self.v_host[:, host].copy_(self.v[:, dev], non_blocking=False)
        else:
            self.k[:, dev].copy_(self.k_host[:, host])
            self.v[:, dev].copy_(self.v_host[:, host])

    # ---- a step -----------------------------------------------------------------------------

    @torch.no_grad()
    def run(self, batch: Batch) -> StepResult:
        t0 = time.perf_counter()
        for op in batch.kv_copies:
            self.copy_kv(op)
        seqs, ids, positions = self._layout(batch)
        self._dec_cache = None
        tokens: list[int] = []
        if seqs:
            hidden = self._forward(seqs, ids, positions)
            rows = [s.row + s.n - 1 for s in seqs if s.sample]
            logits = self.model.logits(hidden[rows])
            reqs = batch.sampling_requests()
            tokens = [self._sample(r, logits[i]) for i, r in enumerate(reqs)]
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        duration = time.perf_counter() - t0
        self.num_steps += 1
        self.num_tokens += len(positions)
        self.busy_s += duration
        return StepResult(batch, duration, tokens)

    def _layout(self, batch: Batch):
        seqs: list[_Seq] = []
        ids: list[int] = []
        positions: list[int] = []
        dev = self.model.device
        parts = [(c.req, c.start, c.num_tokens, False, c.last) for c in batch.prefill]
        parts += [(r, r.seq_len - 1, 1, True, True) for r in batch.decode]
        for req, start, n, decode, sample in parts:
            if n <= 0:
                if sample:
                    raise ValueError(f"{req.rid}: a last prefill chunk of 0 tokens")
                continue
            all_ids = req.all_ids()
            if start + n > len(all_ids):
                raise ValueError(f"{req.rid}: positions {start}..{start + n} past {len(all_ids)}")
            slots = list(self.kv_slots(req))
            if len(slots) < start + n:
                raise ValueError(
                    f"{req.rid}: kv_slots gives {len(slots)} slots, the step needs {start + n}"
                )
            t = torch.tensor(slots[: start + n], dtype=torch.long, device=dev)
            seqs.append(_Seq(req, start, n, len(ids), t, decode, sample))
            ids.extend(all_ids[start : start + n])
            positions.extend(range(start, start + n))
        return seqs, ids, positions

    def _forward(self, seqs: list[_Seq], ids: list[int], positions: list[int]) -> torch.Tensor:
        model, dev = self.model, self.model.device
        tid = torch.tensor(ids, dtype=torch.long, device=dev)
        if int(tid.max()) >= model.config.vocab_size or int(tid.min()) < 0:
            raise ValueError(f"a token id is outside the model's vocabulary of "
                             f"{model.config.vocab_size}")  # fmt: skip
        cos, sin = model.rope(torch.tensor(positions, dtype=torch.long, device=dev))
        write = torch.cat([s.slots[s.start :] for s in seqs])
        x = model.embed(tid)
        tables = self._tables(seqs) if self.attention == "triton" else None
        for i, layer in enumerate(model.layers):
            q, k, v = layer.qkv(x, cos, sin)
            kp, vp = self.k[i], self.v[i]
            kp[write] = k
            vp[write] = v
            if tables is None:
                attn = self._attend_reference(q, kp, vp, seqs)
            else:
                attn = self._attend_triton(q, kp, vp, seqs, tables)
            x = layer.finish(x, attn)
        return x

    def _attend_reference(self, q, kp, vp, seqs: list[_Seq]) -> torch.Tensor:
        out = torch.empty_like(q)
        dec = [s for s in seqs if s.decode]
        if len(dec) > 1:  # all decode queries at once, over their slots padded to one length
            rows, pad, valid = self._decode_index(dec)
            out[rows] = padded_decode_attention(q[rows], kp[pad], vp[pad], valid)
            seqs = [s for s in seqs if not s.decode]
        for s in seqs:
            k, v = kp[s.slots], vp[s.slots]  # [start + n, Hkv, D], logical order
            qpos = torch.arange(s.start, s.start + s.n, device=q.device)
            mask = torch.arange(s.start + s.n, device=q.device)[None, :] <= qpos[:, None]
            out[s.row : s.row + s.n] = dense_attention(q[s.row : s.row + s.n], k, v, mask)
        return out

    def _decode_index(self, dec: list[_Seq]):
        """(rows [B], padded slots [B, L], valid [B, L]) of decode sequences, once per step."""
        key = id(dec[0].slots)
        if self._dec_cache is not None and self._dec_cache[0] == key:
            return self._dec_cache[1]
        dev = self.model.device
        lens = torch.tensor([s.slots.numel() for s in dec], device=dev)
        pad = torch.nn.utils.rnn.pad_sequence([s.slots for s in dec], batch_first=True)
        valid = torch.arange(pad.shape[1], device=dev)[None, :] < lens[:, None]
        rows = torch.tensor([s.row for s in dec], device=dev)
        self._dec_cache = (key, (rows, pad, valid))
        return rows, pad, valid

    # ---- triton -----------------------------------------------------------------------------

    def _tables(self, seqs: list[_Seq]):
        from sgl_fair.kernels.block_table import BlockTable, pieces_from_slots

        dev, bs = self.model.device, self.block_size
        ext = [s for s in seqs if not s.decode]
        dec = [s for s in seqs if s.decode]

        def table(group: list[_Seq]):
            if not group:
                return None
            pieces = [pieces_from_slots(s.slots.tolist(), bs) for s in group]
            return BlockTable.from_pieces(pieces, bs, device=dev)

        return ext, table(ext), dec, table(dec)

    def _attend_triton(self, q, kp, vp, seqs: list[_Seq], tables) -> torch.Tensor:
        from sgl_fair.kernels.bidir_attention import decode_attention, extend_attention

        ext, ext_table, dec, dec_table = tables
        cfg = self.model.config
        shape = (-1, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        kc, vc = kp.view(shape), vp.view(shape)
        out = torch.empty_like(q)
        if ext:
            rows = torch.cat([torch.arange(s.row, s.row + s.n) for s in ext]).to(q.device)
            qe = q[rows].contiguous()
            out[rows] = extend_attention(qe, kc, vc, ext_table, [s.n for s in ext])
        if dec:
            rows = torch.tensor([s.row for s in dec], device=q.device)
            out[rows] = decode_attention(q[rows].contiguous(), kc, vc, dec_table)
        return out

    # ---- sampling ---------------------------------------------------------------------------

    def _sample(self, req: Request, logits: torch.Tensor) -> int:
        p = req.sampling or {}
        logits = logits[: self.vocab_limit]
        temperature = float(p.get("temperature", 1.0) if p.get("temperature") is not None else 1.0)
        if temperature <= 1e-6:
            token = int(torch.argmax(logits))
        else:
            token = sample_token(
                logits.double() / temperature,
                top_k=int(p.get("top_k") or -1),
                top_p=float(p.get("top_p") if p.get("top_p") is not None else 1.0),
                min_p=float(p.get("min_p") or 0.0),
                seed=sampling_seed(req, req.num_output),
            )
        self._maybe_stop(req, token)
        return token

    def _maybe_stop(self, req: Request, token: int) -> None:
        p = req.sampling or {}
        if p.get("ignore_eos"):
            return
        stops = set(p.get("stop_token_ids") or ())
        if self.eos_token_id is not None:
            stops.add(self.eos_token_id)
        if token in stops:
            # The scheduler finishes a request at output_len tokens: this one is its last.
            req.output_len = req.num_output + 1

    # ---- log-probabilities ------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(self, req: Request) -> Logprobs:
        ids = list(req.input_ids) + list(req.output_ids)
        n_in = len(req.input_ids)
        logits = self.model.forward_full(ids[:-1] if req.output_ids else ids)
        lp = torch.log_softmax(logits[:, : self.vocab_limit].double(), dim=-1)
        inputs: tuple[float | None, ...] = ()
        if req.logprob_start_len >= 0:
            inputs = tuple(
                None if i == 0 else float(lp[i - 1, ids[i]])
                for i in range(req.logprob_start_len, n_in)
            )
        outputs = tuple(float(lp[n_in - 1 + j, t]) for j, t in enumerate(req.output_ids))
        top: tuple = ()
        k = req.top_logprobs_num
        if k > 0:
            rows = lp[n_in - 1 : n_in - 1 + len(req.output_ids)]
            vals, idx = torch.topk(rows, min(k, rows.shape[-1]), dim=-1)
            top = tuple(
                tuple((float(a), int(b)) for a, b in zip(vr, ir, strict=True))
                for vr, ir in zip(vals.tolist(), idx.tolist(), strict=True)
            )
        return Logprobs(inputs, outputs, top)


def padded_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """``q [B, H, D]``, ``k, v [B, L, Hkv, D]`` (padded), ``valid [B, L]`` -> ``[B, H, D]``."""
    group = q.shape[1] // k.shape[2]
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    b, h, d = q.shape
    qg = q.to(work).view(b, k.shape[2], group, d)  # query head h reads KV head h // group
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k.to(work)) / math.sqrt(d)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bkgl,blkd->bkgd", probs, v.to(work)).reshape(b, h, d).to(q.dtype)


def sampling_seed(req: Request, position: int) -> int:
    """The seed of ``req``'s draw at output ``position``: from ``sampling_seed`` or the rid."""
    base = (req.sampling or {}).get("sampling_seed")
    if base is None:
        base = zlib.crc32(req.rid.encode())
    return (int(base) * 1_000_003 + position * 7919 + 12345) % (1 << 62)


def sample_token(
    logits: torch.Tensor, *, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0, seed: int
) -> int:
    """One draw from ``softmax(logits)`` (already divided by the temperature) restricted to
    the ``top_k`` best ids, then to the smallest set whose mass reaches ``top_p``, then to ids
    with probability >= ``min_p`` x the best; deterministic in ``seed``."""
    probs = torch.softmax(logits.double(), dim=-1)
    sorted_p, order = torch.sort(probs, descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if 0 < top_k < sorted_p.numel():
        keep[top_k:] = False
    if top_p < 1.0:
        before = torch.cumsum(sorted_p, 0) - sorted_p  # mass of the better ids
        keep &= before < top_p
    if min_p > 0.0:
        keep &= sorted_p >= min_p * sorted_p[0]
    keep[0] = True
    kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    g = torch.Generator(device="cpu").manual_seed(seed)
    choice = torch.multinomial(kept.cpu() / kept.sum().cpu(), 1, generator=g)
    return int(order[int(choice)])


def tokens_per_second(engine: TorchEngine) -> float:
    return engine.num_tokens / engine.busy_s if engine.busy_s > 0 else math.nan
