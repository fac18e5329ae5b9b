"""Fixtures for the tiny-model tests: one fresh build per session (not the shared cache, so these
tests check what the builder writes today)."""

import pytest

from ballast.models import build_tiny_model


@pytest.fixture(scope="session")
def built_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_build"), preset="tiny", seed=0)
