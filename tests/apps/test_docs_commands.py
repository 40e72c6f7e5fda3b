"""Every launcher command in the README's and docs' shell blocks passes the launcher's checks.

A command a reader copies must not exit 2 at the first flag (issue 41: the README's BROS-inside-
SGLang example passed a hub id where ``--backend sglang`` needs a local model directory). Each
``python -m sgl_fair.launch …`` line of a fenced block goes through what the launcher checks
before it starts anything: ``parse_config`` (every flag) and the tokenizer step of ``serve``
(``load_tokenizer`` and the backend's ``tokenizer_error``: a hub id with ``--backend sglang``).
The files it names are stood in for: a model directory under ``/models`` becomes a temp
directory with a ``config.json`` and a tiny ``tokenizer.json``, a tenants file a one-tenant file.
"""

from __future__ import annotations

import json
import pathlib
import shlex

import pytest

from sgl_fair.launch import parse_config
from sgl_fair.launch.backends import backend_of
from sgl_fair.router.tokenizer import BuiltinTokenizer, load_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _commands() -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        inside, cur = False, ""
        for line in path.read_text().splitlines():
            if line.startswith("```"):
                inside, cur = not inside, ""
                continue
            if not inside:
                continue
            if line.rstrip().endswith("\\"):
                cur += line.rstrip()[:-1] + " "
                continue
            cmd, cur = cur + line, ""
            if "-m sgl_fair.launch" in cmd:
                out.append((path.name, cmd))
    return out


COMMANDS = _commands()


def test_the_docs_have_launcher_commands() -> None:
    assert len(COMMANDS) >= 5  # the extraction itself works


@pytest.mark.parametrize(("doc", "cmd"), COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_a_launcher_command_in_the_docs_passes_the_launchers_checks(doc, cmd, tmp_path) -> None:
    argv = shlex.split(cmd, comments=True)
    argv = argv[argv.index("sgl_fair.launch") + 1 :]
    for i, arg in enumerate(argv):
        if arg.startswith("/models/"):  # a local checkpoint the reader has
            model = tmp_path / pathlib.Path(arg).name
            model.mkdir(exist_ok=True)
            (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
            _tiny_tokenizer(model / "tokenizer.json")
            argv[i] = str(model)
        elif arg.endswith(".toml"):
            tenants = tmp_path / arg
            tenants.write_text('[[tenant]]\nname = "acme"\napi_keys = ["sk-acme-1"]\n')
            argv[i] = str(tenants)
    try:
        cfg = parse_config(argv)
    except SystemExit as e:
        pytest.fail(f"{doc}: `{cmd.strip()}` exits {e.code}")
    tokenizer = load_tokenizer(cfg.model_path)
    why = backend_of(cfg.backend).tokenizer_error(cfg, isinstance(tokenizer, BuiltinTokenizer))
    assert why is None, f"{doc}: `{cmd.strip()}` exits 2: {why}"


def _tiny_tokenizer(path: pathlib.Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
