"""Shared test settings: no hub access, deterministic seeds per test."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)
