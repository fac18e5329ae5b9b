"""Resource pools for the controller tests (the Ray instance is the session one from tests/conftest.py)."""

import os

import pytest


@pytest.fixture(scope="module")
def cpu_pool(ray_session, request):
    import ray

    import toy_workers

    ray.cloudpickle.register_pickle_by_value(toy_workers)
    from ballast.single_controller import ResourcePool

    pool = ResourcePool([4], use_gpu=False, cpus_per_process=1.0, name=f"{request.module.__name__}{os.getpid()}")
    yield pool
    pool.remove()
