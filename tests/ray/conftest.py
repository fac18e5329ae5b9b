"""One local Ray instance for the whole tests/ray session (start-up costs seconds on 2 cores)."""

import os
import tempfile

import pytest


@pytest.fixture(scope="session")
def ray_session():
    import ray

    import toy_workers

    ray.cloudpickle.register_pickle_by_value(toy_workers)
    temp_dir = tempfile.mkdtemp(prefix="ray_", dir="/tmp")
    ray.init(num_cpus=8, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def cpu_pool(ray_session, request):
    from ballast.single_controller import ResourcePool

    pool = ResourcePool([4], use_gpu=False, cpus_per_process=1.0, name=f"{request.module.__name__}{os.getpid()}")
    yield pool
    pool.remove()
