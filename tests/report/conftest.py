"""The built-in GPT-2 example compiled for cuda-sim once per test session, and its report."""

from pathlib import Path

import pytest

import sextant
from sextant.examples import gpt2
from sextant.report.html import write_report
from sextant.runtime.compiled import CompiledModule


@pytest.fixture(scope="session")
def gpt2_compiled() -> CompiledModule:
    model, args = gpt2()
    return sextant.compile(model, args, target="cuda-sim")


@pytest.fixture(scope="session")
def gpt2_report(gpt2_compiled: CompiledModule, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_report(gpt2_compiled, tmp_path_factory.mktemp("report") / "report.html", gpu="H100")
