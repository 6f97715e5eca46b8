"""`make demo` works, and the tool output quoted in the docs is current."""

import io

import pytest

from sextant import demo
from sextant.tools import docgen


def test_demo_runs_and_matches_eager() -> None:
    out = io.StringIO()
    err = demo.run_demo("mlp", out=out)
    text = out.getvalue()
    assert err < 1e-4
    assert "graph @MLP(%x: f32[8,64])" in text
    assert "graph IR after the passes" in text
    assert "max |reference - eager|" in text
    assert "max |sextant cpu - eager|" in text
    assert "schedule @MLP for cpu: 3 launches" in text


def test_demo_cli_exit_code() -> None:
    assert demo.main(["mlp", "--quiet"]) == 0


@pytest.mark.slow  # ~70 s: regenerates every docs snippet
def test_docs_are_up_to_date() -> None:
    """Fails when README.md or docs/*.md quote output the tool no longer produces.

    Fix with `python -m sextant.tools.docgen`.
    """
    cache: dict[str, str] = {}
    stale = []
    for path in docgen.DOCS:
        _, changed = docgen.render(path.read_text(), cache)
        stale += [f"{path.name}:{name}" for name in changed]
    assert not stale, f"stale docs blocks (run `python -m sextant.tools.docgen`): {stale}"


def test_every_docs_block_has_a_generator() -> None:
    names = set()
    for path in docgen.DOCS:
        names |= {m["name"] for m in docgen._BLOCK.finditer(path.read_text())}
    assert names and names <= set(docgen.SNIPPETS)
