"""Multi-node tests: one two-node Ray cluster (head + worker node on this machine) for the module, and
the tiny model and task. Nothing here initialises Ray in the pytest process."""

import shutil

import pytest

from cluster_helpers import LocalCluster
from testkit.e2e import write_tiny_task


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
    return write_tiny_task(tmp_path_factory.mktemp("multinode_task"))
