"""Fixtures for the engine unit tests: a tiny random causal LM directory, built once per session."""

import pytest
import transformers

from testkit.models import build_tiny_causal_lm


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory):
    transformers.utils.logging.disable_progress_bar()
    return build_tiny_causal_lm(str(tmp_path_factory.mktemp("tiny_lm")), seed=0)
