"""The report in a real browser: headless Chromium renders it with no console errors or uncaught
exceptions, every kernel is in the rendered DOM, the graph's boxes link to their kernels.
A screenshot goes to test-output/report.png. Chromium missing is a failure, not a skip."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from sextant.runtime.compiled import CompiledModule

from .cdp import INSTALL_HINT, Chromium, find_chromium

SCREENSHOT = Path(__file__).resolve().parents[2] / "test-output" / "report.png"


@pytest.fixture(scope="module")
def browser() -> Iterator[Chromium]:
    exe = find_chromium()
    if exe is None:
        pytest.fail(f"headless Chromium is needed for this test and was not found: {INSTALL_HINT}")
    with Chromium(exe) as b:
        yield b


def test_errors_are_caught(browser: Chromium, tmp_path: Path) -> None:
    """The error capture itself: a deliberately broken page is reported, a clean one is not."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><p>broken</p><script>console.error("deliberate console error");'
                   "window.addEventListener('load', () => undefinedFunction());</script></body></html>")
    browser.load(bad.as_uri())
    errors = browser.errors()
    assert any("deliberate console error" in e for e in errors), errors
    assert any("undefinedFunction is not defined" in e for e in errors), errors
    good = tmp_path / "good.html"
    good.write_text("<!DOCTYPE html><html><body><p>fine</p><script>console.log('hello')</script></body></html>")
    browser.load(good.as_uri())
    assert browser.errors() == []


def test_report_renders(browser: Chromium, gpt2_report: Path, gpt2_compiled: CompiledModule) -> None:
    browser.load(gpt2_report.as_uri())
    try:
        assert browser.errors() == []
        assert browser.evaluate("document.body.dataset.ready") == "1"  # the page's script ran to the end
        program = gpt2_compiled.stages["program"]
        rendered = browser.evaluate(
            "Array.from(document.querySelectorAll('[data-kernel]'))"
            ".filter(e => e.getBoundingClientRect().height > 0).map(e => e.dataset.kernel)")
        assert sorted(rendered) == sorted(program.kernels)
        boxes = browser.evaluate("document.querySelectorAll('svg.graph a.group').length")
        assert boxes == len(program.launches)
        points = browser.evaluate("document.querySelectorAll('svg.roofline circle').length")
        assert 0 < points <= len(program.launches)
    finally:
        browser.screenshot(SCREENSHOT)
    # clicking a graph box goes to its launch and opens nothing unexpected
    last = len(program.launches) - 1
    browser.evaluate(f"document.querySelector('svg.graph a.group[data-launch=\"{last}\"]')"
                     ".dispatchEvent(new MouseEvent('click', {bubbles: true, cancelable: true}))")
    assert browser.evaluate("location.hash") == f"#launch-{last}"
    assert browser.evaluate(f"document.getElementById('launch-{last}').getBoundingClientRect().top") < 200
    assert browser.errors() == []
