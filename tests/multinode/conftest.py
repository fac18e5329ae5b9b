"""Multi-node tests: one two-node Ray cluster (head + worker node on this machine) for the module, and
the tiny model and task. Nothing here initialises Ray in the pytest process."""

import shutil

import pytest

from cluster_helpers import LocalCluster


@pytest.fixture(scope="module")
def two_node_cluster():
    cluster = LocalCluster(num_cpus_per_node=1, dashboard=True).start()
    try:
        yield cluster
    finally:
        cluster.stop()
        left = cluster.leftover_processes()
        assert not left, f"cluster processes survived the teardown: {left}"
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)  # Ray's session logs; kept when the check fails


@pytest.fixture(scope="module")
def multinode_task(tmp_path_factory):
    from ballast.data import write_repeat_dataset
    from ballast.models import tiny_model_dir

    data_dir = tmp_path_factory.mktemp("multinode_task")
    paths = write_repeat_dataset(str(data_dir), train_size=64, val_size=8, seed=0, k_median=6, k_max=20)
    return {"model": str(tiny_model_dir()), "train": str(paths["train"])}
