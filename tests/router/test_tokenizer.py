"""Tokenizers: the built-in one's exact guarantees (hypothesis), its chat format's prefix
property, streaming detokenization, a tiny Hugging Face tokenizer.json with a Jinja chat
template, and how --model-path is resolved."""

from __future__ import annotations

import json
import random
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_fair.router.tokenizer import (
    BuiltinTokenizer,
    ChatTemplateError,
    IncrementalDecoder,
    Tokenizer,
    load_tokenizer,
    render_builtin_chat,
)

TOK = BuiltinTokenizer()
# Deterministic (the suite's rule): the same examples every run, enough of them to matter.
PROPERTY = settings(derandomize=True, deadline=None, max_examples=300)
LO, HI = TOK.output_token_range

# Text that exercises every piece class and their boundaries.
TRICKY = st.text(alphabet=st.sampled_from(list(" \n\t\r  abcZ09_-.,!?é中😀\x00\x1f")), max_size=40)
WORD_IDS = st.integers(min_value=LO, max_value=HI - 1)
# Pseudo-words, their fragments (which recombine into words) and tricky characters:
# where text is cut matters only for pseudo-word recognition, so the text must have them.
SOME_WORDS = [TOK.decode([i]) for i in (LO, LO + 1, LO + 777, LO + 8099, LO + 8100, HI - 1)]
FRAGMENTS = sorted({f for w in SOME_WORDS for k in range(len(w)) for f in (w[:k], w[k:])})
WORDY = st.lists(
    st.one_of(st.sampled_from(SOME_WORDS), st.sampled_from(FRAGMENTS), TRICKY), max_size=10
).map("".join)
ANY_TEXT = st.one_of(st.text(max_size=60), TRICKY, WORDY)


def char_class(c: str) -> str:
    if c.isascii() and c.isalpha():
        return "letter"
    if c in "0123456789":
        return "digit"
    if c.isspace() and c != " ":
        return "space"
    return "other"


def reference_pieces(s: str) -> list[str]:
    """The piece rule of BuiltinTokenizer's docstring, written as a plain scanner."""
    pieces, i = [], 0
    while i < len(s):
        j = i + 1 if s[i] == " " else i
        if j < len(s) and s[j] != " ":
            kind, k = char_class(s[j]), j + 1
            while k < len(s) and s[k] != " " and char_class(s[k]) == kind:
                k += 1
            pieces.append(s[i:k])
            i = k
        else:  # a lone space
            pieces.append(" ")
            i += 1
    return pieces


WORDS = {TOK.decode([i]): i for i in range(LO, HI)}


def reference_encode(s: str) -> list[int]:
    ids: list[int] = []
    for p in reference_pieces(s):
        if p in WORDS:
            ids.append(WORDS[p])
        else:
            ids.extend(b + 3 for b in p.encode())
    return ids


# ---- vocabulary -----------------------------------------------------------------------------


def test_vocabulary_layout():
    assert isinstance(TOK, Tokenizer)
    assert (TOK.vocab_size, TOK.eos_token_id, TOK.output_token_range) == (32000, 2, (259, 32000))
    assert [TOK.token_text(i) for i in range(3)] == ["<pad>", "<s>", "</s>"]
    assert TOK.decode([0, 1, 2]) == ""  # special tokens are skipped by default
    assert TOK.decode([1, 2], skip_special_tokens=False) == "<s></s>"
    assert [TOK.token_bytes(3 + b) for b in (0, 65, 255)] == [b"\x00", b"A", b"\xff"]
    words = [TOK.decode([i]) for i in range(LO, HI)]
    assert len(set(words)) == HI - LO == 31741
    assert all(re.fullmatch(r" (?:[a-z]{4}|[a-z]{6})", w) for w in words)
    # 2- and 3-syllable words are both present; the set is fixed (deterministic)
    assert sum(len(w) == 5 for w in words) == 8100
    assert BuiltinTokenizer().decode(list(range(LO, LO + 50))) == "".join(words[:50])


def test_encode_examples():
    assert TOK.encode("") == []
    word = TOK.decode([LO + 123])
    assert TOK.encode(word) == [LO + 123]
    assert TOK.encode(word + word) == [LO + 123, LO + 123]
    # without its leading space (or glued to more letters) a word is bytes
    assert TOK.encode(word[1:]) == [b + 3 for b in word[1:].encode()]
    assert TOK.encode(word + "x") == [b + 3 for b in (word + "x").encode()]
    # text that looks like a special token is plain bytes: no control-token injection
    assert TOK.encode("</s>") == [b + 3 for b in b"</s>"]
    assert 2 not in TOK.encode("<s>hi</s>")


def test_out_of_range_ids_are_refused():
    for bad in ([-1], [32000], [5, 99999]):
        with pytest.raises(ValueError, match="out of range"):
            TOK.decode(bad)
    with pytest.raises(ValueError):
        TOK.token_text(-1)


@PROPERTY
@given(ANY_TEXT)
def test_encode_follows_the_documented_piece_rule(s):
    assert TOK.encode(s) == reference_encode(s)


@PROPERTY
@given(ANY_TEXT)
def test_decode_inverts_encode(s):
    assert TOK.decode(TOK.encode(s)) == s


# ---- prefix stability -----------------------------------------------------------------------


def cut_is_safe(a: str, b: str) -> bool:
    """The docstring's condition for encode(a + b) == encode(a) + encode(b)."""
    return not (b[:1].isascii() and b[:1].isalpha()) or not re.search(r" [A-Za-z]*\Z", a)


@PROPERTY
@given(ANY_TEXT, ANY_TEXT)
def test_concatenation_where_the_docstring_promises_it(a, b):
    if cut_is_safe(a, b):
        assert TOK.encode(a + b) == TOK.encode(a) + TOK.encode(b)


@PROPERTY
@given(ANY_TEXT, ANY_TEXT)
def test_concatenation_when_b_starts_with_a_space_or_newline(a, rest):
    for b in (" " + rest, "\n" + rest):
        assert TOK.encode(a + b) == TOK.encode(a) + TOK.encode(b)


def test_concatenation_fails_only_inside_a_word():
    """The other cuts really can change the tokens: the condition is not vacuous."""
    w = TOK.decode([LO])  # " xxxx"
    assert not cut_is_safe(w[:3], w[3:]) and not cut_is_safe("a ", w[1:])
    assert TOK.encode(w[:3] + w[3:]) == [LO] != TOK.encode(w[:3]) + TOK.encode(w[3:])
    assert TOK.encode("a " + w[1:]) != TOK.encode("a ") + TOK.encode(w[1:])
    assert TOK.encode(w + "x") != TOK.encode(w) + TOK.encode("x")


@PROPERTY
@given(st.lists(WORD_IDS, max_size=50))
def test_generated_text_retokenizes_to_the_same_ids(ids):
    assert TOK.encode(TOK.decode(ids)) == ids


def test_every_output_id_is_visible_and_roundtrips():
    for i in range(LO, HI):
        text = TOK.decode([i])
        assert text and TOK.encode(text) == [i]
        assert not TOK.is_special(i)


# ---- chat format ----------------------------------------------------------------------------

ROLES = st.sampled_from(["system", "user", "assistant", "developer", "tool"])
MESSAGES = st.lists(st.fixed_dictionaries({"role": ROLES, "content": ANY_TEXT}), max_size=6)


def test_builtin_chat_format():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|system|>\nBe brief.\n<|user|>\nHi\n"
    assert render_builtin_chat(msgs, False) == expected
    assert TOK.apply_chat_template(msgs) == expected + "<|assistant|>\n"
    assert TOK.apply_chat_template(msgs, add_generation_prompt=False) == expected


@PROPERTY
@given(MESSAGES, st.fixed_dictionaries({"role": ROLES, "content": ANY_TEXT}))
def test_one_more_turn_extends_text_and_tokens(msgs, new):
    old = TOK.apply_chat_template(msgs, add_generation_prompt=False)
    longer = TOK.apply_chat_template([*msgs, new], add_generation_prompt=False)
    assert longer.startswith(old)
    assert TOK.encode(longer)[: len(TOK.encode(old))] == TOK.encode(old)
    with_prompt = TOK.apply_chat_template([*msgs, new], add_generation_prompt=True)
    assert TOK.encode(with_prompt)[: len(TOK.encode(longer))] == TOK.encode(longer)


@PROPERTY
@given(MESSAGES, st.lists(WORD_IDS, min_size=1, max_size=20), ANY_TEXT)
def test_multi_turn_prompt_plus_reply_is_a_token_prefix_of_the_next_prompt(msgs, out, user):
    """Turn k's prompt ids + the ids the engine generated are exactly where turn k+1's
    prompt starts, so the prefix cache holds the whole previous request."""
    msgs = [*msgs, {"role": "user", "content": "question"}]
    prompt = TOK.encode(TOK.apply_chat_template(msgs))
    reply = TOK.decode(out)
    nxt = [*msgs, {"role": "assistant", "content": reply}, {"role": "user", "content": user}]
    assert TOK.encode(TOK.apply_chat_template(nxt))[: len(prompt) + len(out)] == prompt + out
    # any reply text (a client may edit it): the prompt's tokens still lead
    edited = [*msgs, {"role": "assistant", "content": user}, {"role": "user", "content": "ok"}]
    assert TOK.encode(TOK.apply_chat_template(edited))[: len(prompt)] == prompt


# ---- streaming detokenization ---------------------------------------------------------------


def test_incremental_decoder_holds_back_a_split_character():
    ids = TOK.encode("é😀")  # 2 + 4 byte tokens
    dec = IncrementalDecoder(TOK)
    assert dec.feed(ids[:1]) == ""
    assert dec.feed(ids[1:3]) == "é"
    assert dec.feed(ids[3:5]) == ""
    assert dec.feed(ids[5:]) == "😀"
    assert dec.finish() == ""
    assert dec.text == "é😀"


def test_incremental_decoder_flushes_an_incomplete_tail():
    dec = IncrementalDecoder(TOK)
    assert dec.feed(TOK.encode("ab") + TOK.encode("é")[:1]) == "ab"
    assert dec.finish() == "\ufffd"
    assert dec.text == "ab\ufffd" == TOK.decode(dec.ids)


@PROPERTY
@given(
    st.lists(st.integers(min_value=0, max_value=TOK.vocab_size - 1), max_size=40),
    st.randoms(use_true_random=False),
)
def test_incremental_decoder_matches_decode_under_any_chunking(ids, rnd):
    dec = IncrementalDecoder(TOK)
    i, deltas = 0, []
    while i < len(ids):
        j = i + rnd.randint(1, 4)
        deltas.append(dec.feed(ids[i:j]))
        i = j
    deltas.append(dec.finish())
    assert "".join(deltas) == dec.text == TOK.decode(ids)


def test_encode_is_fast():
    rng = random.Random(0)
    words = TOK.decode([rng.randrange(LO, HI) for _ in range(20_000)])
    english = "The quick brown fox jumps over the lazy dog. " * 2_000  # 90 kB of bytes
    t0 = time.perf_counter()
    TOK.encode(words)
    TOK.encode(english)
    assert time.perf_counter() - t0 < 1.0  # ~0.03 s here; a per-character loop is ~10x


# ---- Hugging Face tokenizer.json ------------------------------------------------------------

CORPUS = [
    "hello world, this is a tiny tokenizer",
    "the quick brown fox jumps over the lazy dog",
    "naïve café déjà vu 😀",
] * 3

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    "{% if greeting is defined %}{{ greeting }}{% endif %}"
)


def make_hf_dir(tmp_path, *, config=None, files=None):
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|begin|>", "<|end|>", "<|eot|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    d = tmp_path / "model"
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"))
    cfg = {
        "bos_token": "<|begin|>",
        "eos_token": {"content": "<|end|>", "special": True},
        "chat_template": TEMPLATE,
    }
    if config is not None:
        cfg = config
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    for name, text in (files or {}).items():
        (d / name).write_text(text)
    return d


def test_hf_tokenizer_loads_and_roundtrips(tmp_path):
    d = make_hf_dir(tmp_path, files={"generation_config.json": '{"eos_token_id": [1, 2]}'})
    tok = load_tokenizer(str(d))
    assert type(tok).__name__ == "HFTokenizer" and isinstance(tok, Tokenizer)
    assert tok.name == str(d)
    rust = pytest.importorskip("tokenizers").Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.vocab_size == rust.get_vocab_size(with_added_tokens=True) > 259
    assert tok.eos_token_id == 1  # tokenizer_config's eos_token wins...
    assert tok.eos_token_ids == (1, 2)  # ...and generation_config's are stop ids too
    for text in CORPUS[:3] + ["unseen wörds"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.token_text(1) == "<|end|>"
    assert tok.decode([1, *tok.encode("hi")]) == "hi"  # specials skipped by default
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


def test_hf_output_range_is_clean_text(tmp_path):
    tok = load_tokenizer(str(make_hf_dir(tmp_path)))
    lo, hi = tok.output_token_range
    assert 3 <= lo < hi <= tok.vocab_size and hi - lo > 50
    for i in range(lo, hi):
        text = tok.token_text(i)
        assert text and "\ufffd" not in text and not tok.is_special(i)


def test_hf_chat_template(tmp_path):
    tok = load_tokenizer(str(make_hf_dir(tmp_path)))
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<|begin|>[user] hi<|end|>[assistant] "
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<|begin|>[user] hi<|end|>"
    assert tok.apply_chat_template(msgs, False, {"greeting": "!"}).endswith("<|end|>!")
    with pytest.raises(ChatTemplateError, match="no tools here"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    ids = tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    assert ids[0] == tok.encode("<|begin|>", add_special_tokens=False)[0] == 0


def test_hf_template_sources(tmp_path):
    # chat_template.jinja beats tokenizer_config; a list of named templates picks "default"
    a = make_hf_dir(tmp_path / "a", files={"chat_template.jinja": "J{{ messages|length }}"})
    assert load_tokenizer(str(a)).apply_chat_template([{"role": "user", "content": "x"}]) == "J1"
    listed = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default",
              "template": "D"}], "eos_token": "<|eot|>"}  # fmt: skip
    b = load_tokenizer(str(make_hf_dir(tmp_path / "b", config=listed)))
    assert b.apply_chat_template([]) == "D" and b.eos_token_id == 2
    # no template at all: the built-in format; eos from config.json
    c = make_hf_dir(tmp_path / "c", config={}, files={"config.json": '{"eos_token_id": 2}'})
    c_tok = load_tokenizer(str(c))
    msgs = [{"role": "user", "content": "x"}]
    assert c_tok.apply_chat_template(msgs) == render_builtin_chat(msgs, True)
    assert c_tok.eos_token_id == 2


def test_hf_incremental_decoder_never_splits_characters(tmp_path):
    tok = load_tokenizer(str(make_hf_dir(tmp_path)))
    text = "naïve café 😀 déjà vu"
    ids = tok.encode(text)
    for step in (1, 2, 3):
        dec = IncrementalDecoder(tok)
        deltas = [dec.feed(ids[i : i + step]) for i in range(0, len(ids), step)]
        deltas.append(dec.finish())
        assert "".join(deltas) == text == dec.text
        assert all("\ufffd" not in d for d in deltas)


# ---- --model-path ---------------------------------------------------------------------------


def test_builtin_and_hub_names():
    assert load_tokenizer(None).name == "builtin"
    assert isinstance(load_tokenizer("builtin"), BuiltinTokenizer)
    tok = load_tokenizer("meta-llama/Llama-3.1-8B")
    assert isinstance(tok, BuiltinTokenizer) and tok.name == "meta-llama/Llama-3.1-8B"


@pytest.mark.parametrize("path", ["/no/such/model", "./typo-dir", "llama-local", "a/b/c"])
def test_missing_paths_are_errors_not_builtin(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"--model-path") as e:
        load_tokenizer(path)
    assert path in str(e.value)


def test_local_looking_org_name_is_an_error(tmp_path, monkeypatch):
    """ "models/llama" where ./models exists is a mistyped local path, not a hub id."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(ValueError, match="models/llama"):
        load_tokenizer("models/llama")


def test_broken_tokenizer_files_name_the_flag(tmp_path):
    pytest.importorskip("tokenizers")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"--model-path .*cannot load the tokenizer"):
        load_tokenizer(str(tmp_path))
    d = make_hf_dir(tmp_path / "t", config={"chat_template": "{% if %}"})
    with pytest.raises(ValueError, match="chat template does not compile"):
        load_tokenizer(str(d))


def test_directory_without_tokenizer_json(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no tokenizer.json") as e:
        load_tokenizer(str(tmp_path))
    assert "--model-path" in str(e.value)
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer(str(tmp_path / "config.json"))


@PROPERTY
@given(st.lists(WORD_IDS, min_size=1, max_size=5))
def test_token_text_of_words_is_their_decoding(ids):
    assert "".join(TOK.token_text(i) for i in ids) == TOK.decode(ids)
