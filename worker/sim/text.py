"""What the simulated model "says": where it stops (EOS) and text that looks like text.

Both are pure functions of the request id (and position), like a seeded model: the same
request gives the same output on any worker, under any policy, in any run.

**EOS.** A real model stops at an end-of-sequence token long before a large
``max_new_tokens`` (a chat request without ``max_tokens`` gets the context length as its cap).
``EosLengths`` draws the length at which the simulated model would emit EOS from a log-normal
distribution: by default median 192 tokens and sigma 0.9 (mean ≈ 288, P90 ≈ 610), about the
shape of ShareGPT's answer lengths. A request that sets ``ignore_eos`` runs to its cap, as
with SGLang; so do the simulator's own workloads, whose lengths are fixed up front.

**Text.** The engine emits tokens from the tokenizer's word range; ``TextModel`` also puts in
sentence ends, commas and paragraph breaks, so stop strings such as ``"."`` or ``"\\n"`` fire as
they would with a model. Per position, after a word: ``"."`` with probability
``period_rate`` (1/14: sentences of ~14 words), ``","`` with ``comma_rate`` (1/12); after a
``"."``: a newline with ``newline_after_period`` (1/4: paragraphs of ~4 sentences). A
punctuation token never follows another one, and the first output token is a word.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from statistics import NormalDist

_UNIT = float(1 << 32)


def unit_hash(rid: str, position: int, salt: int) -> float:
    """A uniform number in (0, 1), a pure function of its arguments. (A cryptographic hash:
    CRC32 is linear, so coins drawn from it at neighbouring positions were correlated.)"""
    digest = hashlib.blake2b(f"{salt}:{position}:{rid}".encode(), digest_size=4).digest()
    return (int.from_bytes(digest, "little") + 0.5) / _UNIT


@dataclass(frozen=True)
class EosLengths:
    """Output lengths at which the simulated model emits EOS (log-normal, per request id)."""

    median: float = 192.0
    sigma: float = 0.9

    def __post_init__(self) -> None:
        if not (self.median >= 1 and math.isfinite(self.median)):
            raise ValueError(f"EOS median must be a finite number >= 1 (got {self.median})")
        if not (0 <= self.sigma <= 5):
            raise ValueError(f"EOS sigma must be in 0..5 (got {self.sigma})")

    def length(self, rid: str) -> int:
        """Tokens request ``rid`` generates before it stops on its own, EOS included."""
        z = NormalDist().inv_cdf(unit_hash(rid, 0, salt=0xE05))
        return max(1, round(self.median * math.exp(self.sigma * z)))

    @classmethod
    def parse(cls, spec: str) -> EosLengths | None:
        """``"off"`` (never stop early), ``"MEDIAN"`` or ``"MEDIAN,SIGMA"``."""
        text = spec.strip().lower()
        if text in ("off", "none", "0"):
            return None
        parts = text.split(",")
        if len(parts) > 2:
            raise ValueError(f"expected MEDIAN[,SIGMA] or off (got {spec!r})")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"expected MEDIAN[,SIGMA] or off (got {spec!r})") from None
        return cls(*values)


WORD, PERIOD, COMMA, NEWLINE = range(4)


@dataclass(frozen=True)
class TextModel:
    """Where punctuation goes in simulated output; the ids come from the server's tokenizer
    (a tokenizer without a one-token ``"."``/``","``/``"\\n"`` leaves that mark out: None)."""

    period_id: int | None
    comma_id: int | None
    newline_id: int | None
    period_rate: float = 1 / 14
    comma_rate: float = 1 / 12
    newline_after_period: float = 1 / 4

    def _raw(self, rid: str, position: int) -> int:
        u = unit_hash(rid, position, salt=0x7E7)
        if u < self.period_rate:
            return PERIOD
        if u < self.period_rate + self.comma_rate:
            return COMMA
        return WORD

    # Exact, with no scan from the start: ``_period(q)`` is "position q holds a period", and a
    # newline at p needs a period at p - 1. The mutual recursion stops within a few steps
    # (each step back needs another period two positions earlier).
    def _period(self, rid: str, q: int) -> bool:
        return (
            q >= 1
            and self._raw(rid, q) == PERIOD
            and (q == 1 or self._raw(rid, q - 1) == WORD)
            and not self._newline(rid, q - 1)
        )

    def _newline(self, rid: str, p: int) -> bool:
        return (
            p >= 2
            and unit_hash(rid, p, salt=0xA1) < self.newline_after_period
            and self._period(rid, p - 1)
        )

    def kind(self, rid: str, position: int) -> int:
        """WORD, PERIOD, COMMA or NEWLINE for output position ``position`` of ``rid``."""
        if position == 0:
            return WORD
        if position >= 2 and self._raw(rid, position - 1) != WORD:
            # position - 1 may hold a mark: this one is a word, or a paragraph break
            return NEWLINE if self._newline(rid, position) else WORD
        if self._newline(rid, position - 1):
            return WORD  # a paragraph starts with a word
        return self._raw(rid, position)

    def mark_id(self, rid: str, position: int) -> int | None:
        """The punctuation token at this position, or None for a word."""
        kind = self.kind(rid, position)
        if kind == PERIOD:
            return self.period_id
        if kind == COMMA:
            return self.comma_id
        if kind == NEWLINE:
            return self.newline_id
        return None
