"""Shared fixtures: tiny random-weight models built here, engines on them, and real stacks."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench.tiny_models import tiny_model_dir  # noqa: E402
# the reliability run's figures, rendered into docs/reliability.md
from reliability import pytest_runtest_logreport, pytest_sessionfinish, reliability  # noqa: E402,F401

FULL = os.environ.get("VERITY_FULL") == "1"


def pytest_configure(config):
    from cli.blas import blas_preloaded

    if not blas_preloaded():
        print("warning: the optimized BLAS is not preloaded; run pytest as the README says", file=sys.stderr)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory, "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_lm(tiny_llama):
    from worker.loader import load_model

    return load_model(str(tiny_llama))
