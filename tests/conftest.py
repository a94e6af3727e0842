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
def thinking_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny qwen3_5 with Qwen3.5's thinking template, and a noisy copy of it as its draft."""
    from bench.tiny_models import THINKING_TEMPLATE, build_tiny_model

    root = tmp_path_factory.mktemp("thinking")
    target = build_tiny_model(root / "target", "qwen3_5", seed=0, chat_template=THINKING_TEMPLATE)
    return target, build_tiny_model(root / "draft", "qwen3_5", seed=1, perturb_from=target, noise=0.3)


@pytest.fixture(scope="module")
def client(stack):
    """The openai SDK on the module's `stack`."""
    import openai

    return openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def tiny_llama_lm(tiny_llama):
    from worker.loader import load_model

    return load_model(str(tiny_llama))
