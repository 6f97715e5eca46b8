"""Shared test settings: no hub access, deterministic seeds per test."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# tests inspect every stage of what they compile (a cache hit has the artifact's stages only), and
# must not depend on earlier runs: the compile cache's own tests turn it on in a temporary directory
os.environ.setdefault("SEXTANT_COMPILE_CACHE", "0")
# compile in the test process: pytest-xdist already keeps every core busy, and a fork from a
# worker that has run torch (its thread pools, Inductor's compile workers) can inherit a held
# lock and hang — seen in the fresh-clone CI; the forked path has its own tests (test_objects.py)
os.environ.setdefault("SEXTANT_COMPILE_JOBS", "1")
# measured tile choices (tools/tune.py) stay out of tests unless a test opts in with its own store
os.environ.setdefault("SEXTANT_TUNING", "0")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)
