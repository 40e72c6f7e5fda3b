"""Tokenizers for the HTTP front: a deterministic built-in one and Hugging Face ``tokenizer.json``.

The server tokenizes every request itself (the router places requests by their token
prefix, and fairness charges tokens), so it needs a tokenizer even when the engine is
the simulator and no model is on disk. Two implementations share the :class:`Tokenizer`
protocol:

* :class:`BuiltinTokenizer` needs no files. Its vocabulary (32,000 ids) is 3 special
  tokens, the 256 raw bytes and 31,741 pseudo-words (``" bako"``, ``" tifemu"``), so
  *any* text encodes (bytes as the fallback) and decodes back exactly, and a simulated
  engine that emits pseudo-words produces readable, re-tokenizable text.
* :class:`HFTokenizer` (``tokenizer_hf.py``) loads a model directory's ``tokenizer.json``
  with the ``tokenizers`` library and renders its Jinja chat template with ``jinja2``
  (both are optional dependencies, imported only when a directory is loaded;
  ``transformers`` is not needed).

:func:`load_tokenizer` picks one from ``--model-path``; :class:`IncrementalDecoder`
turns a stream of token ids into text deltas for streaming responses.

This module is pure: no network, no torch, no sglang.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "BUILTIN_NAME",
    "BuiltinTokenizer",
    "ChatTemplateError",
    "IncrementalDecoder",
    "Tokenizer",
    "load_tokenizer",
    "render_builtin_chat",
]

BUILTIN_NAME = "builtin"


@runtime_checkable
class Tokenizer(Protocol):
    """What the server needs from a tokenizer.

    ``output_token_range`` is ``[lo, hi)``: the ids a simulated engine may emit. Every id
    in it decodes to non-empty text and none is a special token, so simulated output is
    always visible text (and, for the built-in tokenizer, re-tokenizes to the same ids).
    """

    name: str
    vocab_size: int
    eos_token_id: int | None
    output_token_range: tuple[int, int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str: ...


class ChatTemplateError(ValueError):
    """A chat template refused the conversation (its ``raise_exception``) or failed to render.

    A ``ValueError`` so that the server answers 400: the template's complaint is about the
    request (e.g. "roles must alternate user/assistant"), not about the server.
    """


def check_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    # min/max run in C; a negative id would otherwise index a table from its end.
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(i for i in ids if not 0 <= i < vocab_size)
        raise ValueError(f"token id {bad} is out of range for a vocabulary of {vocab_size}")


# ---- the built-in chat format ---------------------------------------------------------------


def render_builtin_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
    """``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n`` for a generation prompt.

    Why this shape: every rendering ends with a newline, so the rendering of
    ``messages[:k]`` (without generation prompt) is a text prefix of the rendering of
    ``messages[:k+1]`` *and* the cut between them is one where the built-in tokenizer
    guarantees ``encode(a + b) == encode(a) + encode(b)`` (``a`` does not end inside a
    space-plus-letters run). So a conversation re-sent with one more turn re-tokenizes to
    the earlier turns' tokens plus new ones, and a generation prompt followed by the
    assistant's reply (whatever it is) re-tokenizes to the prompt's tokens plus the
    reply's: the prefix cache keeps working across turns.
    """
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


# ---- the built-in tokenizer -----------------------------------------------------------------

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]  # 90
_N_SPECIAL = 3
_BYTE_BASE = _N_SPECIAL  # ids 3 .. 258 are the bytes 0 .. 255
_WORD_BASE = _BYTE_BASE + 256  # 259
_VOCAB_SIZE = 32000
_N_WORDS = _VOCAB_SIZE - _WORD_BASE  # 31,741
_SPECIALS = ("<pad>", "<s>", "</s>")


def _pseudo_words() -> list[str]:
    """31,741 distinct lowercase words: all 8,100 two-syllable ones, then three-syllable ones.

    Syllables are consonant + vowel, so a word splits back into syllables one way only and
    two- and three-syllable words differ in length: every word is distinct. The
    three-syllable ones are taken in a fixed stride order (7919 is coprime with 90**3) so
    that they are spread over the whole syllable space instead of all starting with "ba".
    """
    n = len(_SYLLABLES)
    words = [a + b for a in _SYLLABLES for b in _SYLLABLES]
    total3 = n**3
    for i in range(_N_WORDS - len(words)):
        j = (i * 7919) % total3
        words.append(_SYLLABLES[j // (n * n)] + _SYLLABLES[(j // n) % n] + _SYLLABLES[j % n])
    return words


# Pieces, tried in this order at each position (leftmost match; every character is covered):
#   " ?[A-Za-z]+"      an optional single space, then a run of ASCII letters
#   " ?[0-9]+"         an optional single space, then a run of ASCII digits
#   " ?[^\sA-Za-z0-9]+" an optional single space, then a run of other non-whitespace
#   " ?[^\S ]+"        an optional single space, then a run of whitespace other than " "
#   " "                a lone space (one followed by another space, or at the end)
# A space can only be the *first* character of a piece, so every " " starts a piece.
_PIECE = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+| ?[^\S ]+| ")


class BuiltinTokenizer:
    """A deterministic 32,000-token vocabulary that needs no files.

    Ids: ``0 = <pad>``, ``1 = <s>`` (BOS), ``2 = </s>`` (EOS); ``3 .. 258`` are the 256
    raw bytes; ``259 .. 31999`` are pseudo-words, each decoding to ``" "`` + a lowercase
    word of two or three consonant-vowel syllables.

    **Encoding.** The text is split into pieces by ``_PIECE`` (see its comment): runs of
    letters, of digits, of other non-space characters and of non-space whitespace, each
    with an optional single leading space, and lone spaces. A piece that is exactly a
    pseudo-word (with its leading space) becomes that word's id; any other piece becomes
    the ids of its UTF-8 bytes. ``encode`` never adds BOS/EOS, and text that looks like a
    special token (``"</s>"``) encodes as bytes: clients cannot inject control tokens.

    **Guarantees** (property-tested):

    * ``decode(encode(s)) == s`` for every string (lone surrogates, which JSON text cannot
      carry, excepted).
    * Prefix stability, the point of which is prefix caching on text (a chat history
      re-sent with a new turn appended re-tokenizes to the old tokens plus new ones):
      ``encode(a + b) == encode(a) + encode(b)`` whenever ``b`` does not start with an
      ASCII letter (in particular when it starts with a space or a newline), or ``a``
      does not end with a space followed by zero or more ASCII letters.

      Why exactly this: non-word pieces become their bytes, and bytes concatenate, so
      only the recognition of pseudo-words depends on where the text is cut. A
      pseudo-word is a space plus a *maximal* run of letters, so a cut can only create,
      break or extend one when ``a`` ends inside such a run (``" "`` + letters) and
      ``b`` continues it with a letter: ``"a " + "bako"`` or ``" ba" + "ko"``.
    * For ids in ``output_token_range = (259, 32000)`` (the pseudo-words):
      ``encode(decode(ids)) == ids`` for any sequence, so text that a client received and
      sends back re-tokenizes to the ids the engine generated.
    """

    vocab_size = _VOCAB_SIZE
    bos_token_id = 1
    eos_token_id = 2
    eos_token_ids = (2,)
    output_token_range = (_WORD_BASE, _VOCAB_SIZE)

    def __init__(self, name: str = BUILTIN_NAME) -> None:
        self.name = name
        words = _pseudo_words()
        self._word_ids: dict[str, int] = {" " + w: _WORD_BASE + i for i, w in enumerate(words)}
        byte_items = [bytes([b]) for b in range(256)]
        word_items = [(" " + w).encode() for w in words]
        # decode tables: id -> bytes (special tokens empty, or their text)
        self._bytes_skip: list[bytes] = [b""] * _N_SPECIAL + byte_items + word_items
        self._bytes_all: list[bytes] = [s.encode() for s in _SPECIALS] + byte_items + word_items
        self._byte_id = tuple(range(_BYTE_BASE, _BYTE_BASE + 256)).__getitem__

    # -- Tokenizer protocol --

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (``add_special_tokens`` is accepted and ignored: no BOS)."""
        ids: list[int] = []
        get = self._word_ids.get
        byte_id = self._byte_id
        for piece in _PIECE.findall(text):
            wid = get(piece)
            if wid is None:
                ids.extend(map(byte_id, piece.encode("utf-8", "surrogatepass")))
            else:
                ids.append(wid)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 (a byte sequence cut short) becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", "replace")

    def decode_bytes(self, ids: Sequence[int], skip_special_tokens: bool = True) -> bytes:
        check_token_ids(ids, _VOCAB_SIZE)
        table = self._bytes_skip if skip_special_tokens else self._bytes_all
        return b"".join(map(table.__getitem__, ids))

    def token_text(self, token_id: int) -> str:
        """The text of one token; special tokens show as their names (``"</s>"``)."""
        return self.token_bytes(token_id).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        check_token_ids((token_id,), _VOCAB_SIZE)
        return self._bytes_all[token_id]

    def is_special(self, token_id: int) -> bool:
        return 0 <= token_id < _N_SPECIAL

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """:func:`render_builtin_chat` (``template_kwargs`` are accepted and ignored)."""
        return render_builtin_chat(messages, add_generation_prompt)

    def __repr__(self) -> str:
        return f"BuiltinTokenizer(name={self.name!r})"


# ---- choosing one ---------------------------------------------------------------------------

# "org/name" as the Hugging Face hub spells model ids.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+")


def load_tokenizer(model_path: str | None) -> Tokenizer:
    """The tokenizer for ``--model-path``.

    * ``None`` or ``"builtin"``: :class:`BuiltinTokenizer`.
    * A local directory with ``tokenizer.json``: :class:`HFTokenizer` (needs the optional
      ``tokenizers`` and, for chat templates, ``jinja2`` packages). A path to a
      ``tokenizer.json`` file means its directory.
    * A hub model id such as ``"meta-llama/Llama-3.1-8B"`` (``org/name``) that is not a
      local path: :class:`BuiltinTokenizer` whose ``name`` is that id. The simulator only
      uses it as the served model name; nothing is downloaded.
    * Anything else raises ``ValueError`` naming ``--model-path`` and the path: a
      directory without ``tokenizer.json``, a missing path (e.g. a typo in a local
      directory: the built-in tokenizer is never silently used instead), or a missing
      ``tokenizers`` package.
    """
    if model_path is None or model_path == BUILTIN_NAME:
        return BuiltinTokenizer()
    path = Path(model_path).expanduser()
    if path.is_file() and path.name == "tokenizer.json":
        path = path.parent
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ValueError(
                f"--model-path {model_path!r}: the directory has no tokenizer.json (only "
                "Hugging Face fast tokenizers are supported); use --model-path builtin for "
                "the built-in tokenizer"
            )
        try:
            import tokenizers  # noqa: F401
        except ImportError as e:
            raise ValueError(
                f"--model-path {model_path!r}: loading tokenizer.json needs the 'tokenizers' "
                "package (pip install tokenizers jinja2)"
            ) from e
        try:
            from sgl_fair.router.tokenizer_hf import HFTokenizer

            return HFTokenizer(path)
        except Exception as e:  # any load failure is reported against the flag
            raise ValueError(f"--model-path {model_path!r}: cannot load the tokenizer: {e}") from e
    first = model_path.split("/", 1)[0]
    if _HUB_ID.fullmatch(model_path) and not Path(first).expanduser().exists():
        return BuiltinTokenizer(name=model_path)
    what = "is not a directory" if path.exists() else "does not exist"
    raise ValueError(
        f"--model-path {model_path!r} {what}: give a local model directory with "
        "tokenizer.json, a hub id like 'org/name' (served with the built-in tokenizer), "
        "or 'builtin'"
    )


# ---- streaming detokenization ---------------------------------------------------------------


class IncrementalDecoder:
    """Per-request streaming detokenizer: ``feed(new_ids)`` returns the new complete text.

    It never emits part of a UTF-8 character: for the built-in tokenizer, byte tokens go
    through an incremental UTF-8 decoder that holds back an incomplete tail (exact: the
    concatenated deltas equal ``decode(all ids)``); for other tokenizers, the usual
    "decode a window, diff against the previous decoding" method, holding back text that
    ends in U+FFFD (a character whose bytes are not all there yet) and re-decoding from a
    window start so that tokenizers which strip a leading space from the first token
    decode both windows the same way. ``finish()`` flushes what was held back (an
    incomplete character at the very end becomes U+FFFD). ``text`` is everything
    emitted so far.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._parts: list[str] = []
        self._utf8 = None
        if isinstance(tokenizer, BuiltinTokenizer):
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._prefix_offset = 0
        self._read_offset = 0

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def feed(self, new_ids: Sequence[int]) -> str:
        if not new_ids:
            return ""
        self.ids.extend(new_ids)
        if self._utf8 is not None:
            tok: BuiltinTokenizer = self.tokenizer  # type: ignore[assignment]
            delta = self._utf8.decode(tok.decode_bytes(new_ids, self.skip_special_tokens))
        else:
            delta = self._diff(final=False)
        if delta:
            self._parts.append(delta)
        return delta

    def finish(self) -> str:
        """Emit whatever was held back; call once, after the last ``feed``."""
        delta = self._utf8.decode(b"", final=True) if self._utf8 is not None else self._diff(True)
        if delta:
            self._parts.append(delta)
        return delta

    def _diff(self, final: bool) -> str:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = decode(self.ids[self._prefix_offset : self._read_offset], skip)
        full = decode(self.ids[self._prefix_offset :], skip)
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""
