"""The Hugging Face tokenizer for ``--model-path DIR``: ``tokenizer.json`` and its chat template.

Loaded by :func:`sgl_fair.router.tokenizer.load_tokenizer`, which checks the directory and
the optional packages first (``tokenizers``; ``jinja2`` for chat templates) and reports any
failure against the flag. ``transformers`` is not needed. Pure: no network, no torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sgl_fair.router.tokenizer import ChatTemplateError, check_token_ids, render_builtin_chat


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
        check_token_ids(ids, self.vocab_size)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        check_token_ids((token_id,), self.vocab_size)
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
