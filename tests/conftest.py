"""Shared test fixtures: a small deterministic torch setup and a token cache shared by the session."""

import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def rlm_cache(tmp_path_factory):
    """One RLM_CACHE for every CLI smoke test, so the tiny corpus is tokenized once per session."""
    return tmp_path_factory.mktemp("rlm_cache")
