"""Shared test settings: offline, quiet, deterministic."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP workers starve subprocesses on 2 cores

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_debug_leak(monkeypatch):
    """`--debug` sets EAGLE3FT_DEBUG for the process (and its subprocesses); undone after each test."""
    monkeypatch.setenv("EAGLE3FT_DEBUG", "0")
