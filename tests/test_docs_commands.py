"""Every ``$ sextant ...`` command quoted in docs/cli.md still runs, with the outcome the doc shows.

The doc's ``model.py`` (its Python block) is written to a scratch folder and each command is run
there through ``sextant.cli.main.main``: a command whose quoted output is an error must fail with
that error's first line; any other must succeed. (The quoted numbers — timings, errors — are not
compared: they vary from run to run; docgen-generated blocks cover deterministic output.)
"""

from __future__ import annotations

import io
import re
import shlex
from pathlib import Path

import pytest
import torch

from sextant.cli.main import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
_BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)


def _doc_blocks() -> list[tuple[str, str]]:
    return [(m[1], m[2]) for m in _BLOCK.finditer(DOC.read_text())]


def _commands() -> list[tuple[str, list[str]]]:
    """(command line, the output lines quoted after it) for each ``$ sextant`` block."""
    out = []
    for lang, body in _doc_blocks():
        lines = body.splitlines()
        if lang or not lines or not lines[0].startswith("$ sextant "):
            continue
        out.append((lines[0][2:].split("#")[0].strip(), lines[1:]))
    return out


def test_the_doc_quotes_commands() -> None:
    assert len(_commands()) >= 5


@pytest.mark.parametrize(("command", "quoted"), _commands(), ids=[c for c, _ in _commands()])
def test_documented_command(command: str, quoted: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (model_py,) = [body for lang, body in _doc_blocks() if lang == "python" and "def make" in body]
    (tmp_path / "model.py").write_text(model_py)
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(command)[1:]
    if "--target" in argv and argv[argv.index("--target") + 1] == "cuda" and torch.cuda.is_available():
        pytest.skip("the doc quotes this command on a machine without a GPU")
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, out=out, err=err)
    errors = [line for line in quoted if line.startswith("sextant: error:")]
    if errors:
        assert code != 0
        got = [line for line in err.getvalue().splitlines() if line.startswith("sextant: error:")]
        assert got and _normalise(got[0]) == _normalise(errors[0])
    else:
        assert code == 0, err.getvalue()
        for line in quoted:  # the shape of the output: its first words still appear
            if line and not line[0].isspace() and not line.startswith(("|", "note:")):
                assert line.split()[0] in out.getvalue() + err.getvalue(), line


def _normalise(line: str) -> str:
    return re.sub(r"\S*/(model\.py)", r"\1", line)
