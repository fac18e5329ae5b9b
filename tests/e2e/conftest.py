"""End-to-end runs share the session Ray instance, the cached tiny model and a small synthetic task."""

import pytest

from testkit.e2e import write_tiny_task


@pytest.fixture(scope="session")
def e2e_ray(ray_session):
    return ray_session


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory):
    return write_tiny_task(tmp_path_factory.mktemp("repeat"))


