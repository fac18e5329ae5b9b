"""End-to-end runs share the session Ray instance, the cached tiny model and a small synthetic task."""

import pytest


@pytest.fixture(scope="session")
def e2e_ray(ray_session):
    return ray_session


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory):
    from ballast.data import write_repeat_dataset
    from ballast.models import tiny_model_dir

    data_dir = tmp_path_factory.mktemp("repeat")
    paths = write_repeat_dataset(str(data_dir), train_size=64, val_size=8, seed=0, k_median=6, k_max=20)
    return {"model": str(tiny_model_dir()), "train": str(paths["train"]), "val": str(paths["val"])}


