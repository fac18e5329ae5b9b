"""Fixtures for the agent-loop unit tests: the tiny model and its tokenizer (built once per session)."""

import pytest


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The quickstart's tiny Qwen2 model + byte-level BPE tokenizer with the ChatML template."""
    from ballast.models import build_tiny_model

    return str(build_tiny_model(str(tmp_path_factory.mktemp("tiny_agent")), preset="tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir):
    from ballast.models import load_tokenizer

    return load_tokenizer(tiny_dir)
