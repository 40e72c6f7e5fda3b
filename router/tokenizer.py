"""Tokenizers for the HTTP front: a deterministic built-in one and Hugging Face ``tokenizer.json``.

The server tokenizes every request itself (the router places requests by their token
prefix, and fairness charges tokens), so it needs a tokenizer even when the engine is
the simulator and no model is on disk. Two implementations share the :class:`Tokenizer`
protocol:

* :class:`BuiltinTokenizer` needs no files. Its vocabulary (32,000 ids) is 3 special
  tokens, the 256 raw bytes and 31,741 pseudo-words (``" bako"``, ``" tifemu"``), so
  *any* text encodes (bytes as the fallback) and decodes back exactly, and a simulated
  engine that emits pseudo-words produces readable, re-tokenizable text.
* :class:`HFTokenizer` loads a model directory's ``tokenizer.json`` with the
  ``tokenizers`` library and renders its Jinja chat template with ``jinja2`` (both are
  optional dependencies, imported only when a directory is loaded; ``transformers`` is
  not needed).

:func:`load_tokenizer` picks one from ``--model-path``; :class:`IncrementalDecoder`
turns a stream of token ids into text deltas for streaming responses.

This module is pure: no network, no torch, no sglang.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "BUILTIN_NAME",
    "BuiltinTokenizer",
    "ChatTemplateError",
    "HFTokenizer",
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


def _check_ids(ids: Sequence[int], vocab_size: int) -> None:
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
        _check_ids(ids, _VOCAB_SIZE)
        table = self._bytes_skip if skip_special_tokens else self._bytes_all
        return b"".join(map(table.__getitem__, ids))

    def token_text(self, token_id: int) -> str:
        """The text of one token; special tokens show as their names (``"</s>"``)."""
        return self.token_bytes(token_id).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        _check_ids((token_id,), _VOCAB_SIZE)
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


# ---- Hugging Face tokenizer.json ------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _eos_ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _compile_template(source: str) -> Callable[..., str]:
    """Compile a chat template the way ``transformers`` does: sandboxed, trim/lstrip blocks,
    loop controls, ``raise_exception``, ``tojson`` and ``strftime_now`` available."""
    import datetime

    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ValueError(
            "rendering the model's chat template needs the 'jinja2' package (pip install jinja2)"
        ) from e

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        template = env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the chat template does not compile: {e}") from e

    def render(**variables: Any) -> str:
        try:
            return template.render(**variables)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from e

    return render


def _find_template(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    """``chat_template.jinja`` (newer transformers) or ``tokenizer_config.json``'s
    ``chat_template`` (a string, or a list of ``{"name", "template"}`` of which "default")."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        default = named.get("default")
        if isinstance(default, str):
            return default
    return None


class HFTokenizer:
    """A model directory's ``tokenizer.json`` (the ``tokenizers`` library).

    * ``eos_token_id``: ``tokenizer_config.json``'s ``eos_token`` (a string or
      ``{"content": ...}``), else the first ``eos_token_id`` of ``generation_config.json``,
      else of ``config.json``. ``eos_token_ids`` is the union of all three (Llama 3.1
      Instruct ends turns with any of three ids).
    * Chat template: ``chat_template.jinja`` or ``tokenizer_config.json``'s
      ``chat_template``, rendered with jinja2 like transformers does (sandboxed;
      ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``unk_token``,
      ``pad_token``, ``raise_exception``, plus the request's ``chat_template_kwargs``).
      Without one, the built-in format (:func:`render_builtin_chat`).
    * ``encode(text)`` adds the tokenizer's special tokens (BOS for Llama) like SGLang's
      ``/generate`` does; encode a rendered chat template with
      ``add_special_tokens=False``, since templates write the BOS text themselves.
    * ``output_token_range``: the longest run of consecutive ids that are not added or
      special tokens and whose single-token decoding is non-empty and has no U+FFFD (no
      partial UTF-8 byte tokens), so simulated output is clean visible text. Computed once
      at load (one batched decode of the vocabulary).
    """

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        self.model_dir = Path(model_dir)
        self.name = str(model_dir)
        self._tok = _RustTokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder()
        self._added_ids = frozenset(added)
        self._special_ids = frozenset(i for i, t in added.items() if t.special)

        config = _read_json(self.model_dir / "tokenizer_config.json")
        gen_config = _read_json(self.model_dir / "generation_config.json")
        model_config = _read_json(self.model_dir / "config.json")
        self._special_text: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_content(config.get(key))
            if text is not None:
                self._special_text[key] = text

        eos_ids: list[int] = []
        eos_text = self._special_text.get("eos_token")
        if eos_text is not None and self._tok.token_to_id(eos_text) is not None:
            eos_ids.append(self._tok.token_to_id(eos_text))
        for cfg in (gen_config, model_config):
            eos_ids += [i for i in _eos_ids(cfg.get("eos_token_id")) if i not in eos_ids]
        self.eos_token_ids: tuple[int, ...] = tuple(eos_ids)
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        bos_text = self._special_text.get("bos_token")
        self.bos_token_id: int | None = (
            self._tok.token_to_id(bos_text) if bos_text is not None else None
        )

        source = _find_template(self.model_dir, config)
        self.chat_template: str | None = source
        self._render = _compile_template(source) if source is not None else None
        self.output_token_range: tuple[int, int] = self._clean_range()

    def _clean_range(self) -> tuple[int, int]:
        texts = self._tok.decode_batch(
            [[i] for i in range(self.vocab_size)], skip_special_tokens=False
        )
        best = (0, 0)
        start = None
        for i, text in enumerate([*texts, ""]):  # the sentinel closes the last run
            good = bool(text) and "\ufffd" not in text and i not in self._added_ids
            if good and start is None:
                start = i
            elif not good and start is not None:
                if i - start > best[1] - best[0]:
                    best = (start, i)
                start = None
        if best == (0, 0):
            raise ValueError(f"{self.model_dir}: no token decodes to visible text")
        return best

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        _check_ids(ids, self.vocab_size)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        _check_ids((token_id,), self.vocab_size)
        return self._tok.decode([token_id], skip_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if self._render is None:
            return render_builtin_chat(messages, add_generation_prompt)
        variables: dict[str, Any] = dict(template_kwargs or {})
        variables.update(self._special_text)
        variables["messages"] = messages
        variables["add_generation_prompt"] = add_generation_prompt
        return self._render(**variables)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


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
