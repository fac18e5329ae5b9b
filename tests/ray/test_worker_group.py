"""Worker groups on a local Ray instance: every dispatch mode, mesh layouts, chaining, failures.

One 4-worker group (sp=2 for the "actor" mesh, tp=4 for the "rollout" mesh) and one colocated
consumer group serve most tests; worker processes cost seconds each to start on 2 cores.
"""

import os

import pytest
import torch

from ballast.protocol import Batch
from ballast.single_controller import (
    BatchFuture, RayWorkerGroup, ResourcePool, WorkerDiedError, WorkerError, WorkerTimeoutError,
)


def _batch(n):
    return Batch({"idx": torch.arange(n), "payload": torch.randn(n, 3)}, {"uid": [f"u{i}" for i in range(n)]})


@pytest.fixture(scope="module")
def echo(cpu_pool):
    from toy_workers import EchoWorker

    group = RayWorkerGroup(cpu_pool, EchoWorker, init_kwargs={"sp": 2, "tp": 4}, name="echo", device_share=0.5,
                           timeout_s=120)
    yield group
    group.kill()


@pytest.fixture(scope="module")
def consumer_logs(tmp_path_factory):
    return tmp_path_factory.mktemp("consumer_logs")


@pytest.fixture(scope="module")
def consumer(cpu_pool, echo, consumer_logs):
    from toy_workers import ConsumerWorker

    group = RayWorkerGroup(cpu_pool, ConsumerWorker, name="consumer", device_share=0.5, timeout_s=120,
                           log_dir=str(consumer_logs))
    yield group
    group.kill()


def test_group_layout_env_and_one_to_all(echo):
    infos = echo.whoami()
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    assert {i["world"] for i in infos} == {4}
    assert len({i["master"] for i in infos}) == 1 and infos[0]["master"][1] == str(echo.master_port)
    assert len({i["pid"] for i in infos}) == 4
    assert all(i["threads"] == 1 for i in infos)  # pinned so 2 cores are not oversubscribed
    assert [p["threads"] for p in echo.placement()] == [1, 1, 1, 1]
    from ballast.single_controller.worker_group import CPU_MALLOC_ENV

    assert all(i["malloc"] == CPU_MALLOC_ENV for i in infos)  # CPU workers keep freed memory (glibc)
    placed = echo.placement()
    assert [p["pid"] for p in placed] == [i["pid"] for i in infos] and all(p["node_id"] and p["ip"] for p in placed)
    assert echo.only_rank_zero("x") == (0, "x")
    assert echo.scale([1, 1, 2, 2]) == [1, 2, 6, 8]
    with pytest.raises(ValueError, match="lists of 4"):
        echo.scale([1, 2])


def test_dp_compute_proto_splits_in_rank_order_and_concatenates(echo):
    out = echo.tag(_batch(8))
    assert out["idx"].tolist() == list(range(8))
    assert out["owner"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match=r"6 samples cannot be split evenly over 4"):
        echo.tag(_batch(6))


def test_dp_compute_proto_tracked_padding_is_removed(echo):
    out = echo.tag_padded(_batch(6))
    assert out["idx"].tolist() == list(range(6))  # the 2 pad samples are gone
    assert "pad_count" not in out.meta


def test_mesh_dispatch_peers_get_identical_chunks_and_each_sample_returns_once(echo):
    before = [len(h) for h in echo.history()]
    out = echo.actor_step(_batch(8))  # sp=2: dp ranks {0,1} x sp peers
    assert out["idx"].tolist() == list(range(8))
    assert out["dp_rank"].tolist() == [0] * 4 + [1] * 4
    assert out["worker"].tolist() == [0] * 4 + [2] * 4  # collected from sp rank 0 only
    seen = [h[n:] for h, n in zip(echo.history(), before)]
    assert seen[0] == seen[1] == [("actor", [0, 1, 2, 3])]  # SP peers saw identical data
    assert seen[2] == seen[3] == [("actor", [4, 5, 6, 7])]
    out = echo.rollout_step(_batch(8))  # tp=4: one dp rank; all four TP peers see everything
    assert out["idx"].tolist() == list(range(8)) and set(out["worker"].tolist()) == {0}
    assert all(h[-1] == ("rollout", list(range(8))) for h in echo.history())


def test_non_blocking_future_chains_to_a_colocated_group_without_the_driver(echo, consumer):
    future = echo.produce(_batch(8))  # mesh "actor": 2 dp chunks
    assert isinstance(future, BatchFuture) and len(future.chunk_refs) == 2

    def no_driver_round_trip():
        raise AssertionError("the chained chunk went through the driver")

    future.get = no_driver_round_trip  # consumer's "critic" mesh also has 2 dp ranks: pass-through
    out = consumer.consume(future)
    assert out["idx"].tolist() == list(range(8))
    assert out["value_plus_one"].tolist() == [2 * i + 1 for i in range(8)]
    echo_pids = {i["pid"] for i in echo.whoami()}
    assert not set(out["pid"].tolist()) & echo_pids  # a separate process on a shared bundle


def test_future_with_a_different_layout_is_resplit(echo, consumer):
    out = consumer.consume(echo.produce_per_rank(_batch(8)))  # 4 chunks in, 2 dp ranks out
    assert out["value_plus_one"].tolist() == [2 * i + 1 for i in range(8)]


def test_log_dir_holds_each_workers_python_and_fd_level_output(consumer, consumer_logs):
    assert consumer.say("hello") == [0, 1, 2, 3]
    for rank in range(4):
        text = (consumer_logs / f"consumer_rank{rank}.log").read_text()
        assert f"hello from rank {rank} via print" in text and f"hello from rank {rank} via fd 2" in text
        assert "from rank" not in text.replace(f"from rank {rank}", "")  # each rank its own file


def test_worker_exception_names_rank_method_and_traceback(echo):
    with pytest.raises(WorkerError) as info:
        echo.fail_on(2)
    text = str(info.value)
    assert "echo.fail_on failed on worker rank 2" in text
    assert "boom from rank 2" in text and "in fail_on" in text  # the remote traceback
    assert "\x1b[" not in text  # terminal colour codes stripped
    assert echo.fail_on(-1) == [0, 1, 2, 3]  # the group is still usable


def test_hanging_worker_times_out_naming_the_rank(echo):
    echo.timeout_s = 2
    try:
        with pytest.raises(WorkerTimeoutError, match=r"rank\(s\) \[3\] did not finish within 2s"):
            echo.hang_on(3, 5)
    finally:
        echo.timeout_s = 120


def test_killed_worker_is_reported_not_waited_on(ray_session):
    from toy_workers import EchoWorker

    pool = ResourcePool([2], use_gpu=False, name="dying")
    group = RayWorkerGroup(pool, EchoWorker, name="doomed", timeout_s=120)
    try:
        with pytest.raises(WorkerDiedError, match=r"doomed.die_on: worker rank 1 died"):
            group.die_on(1)
    finally:
        group.kill()
        pool.remove()


def test_a_worker_given_two_cpus_runs_two_threads_and_a_half_share_one(ray_session):
    from toy_workers import EchoWorker

    pool = ResourcePool([1], use_gpu=False, cpus_per_process=2.0, name="wide")
    try:
        whole = RayWorkerGroup(pool, EchoWorker, name="whole", timeout_s=120)
        try:
            assert [i["threads"] for i in whole.whoami()] == [2]
            assert [p["threads"] for p in whole.placement()] == [2]
        finally:
            whole.kill()
        # two groups sharing the slot (actor and critic) split its CPUs
        halves = [RayWorkerGroup(pool, EchoWorker, name=f"half{k}", device_share=0.5, timeout_s=120) for k in (0, 1)]
        try:
            assert [[i["threads"] for i in g.whoami()] for g in halves] == [[1], [1]]
        finally:
            for g in halves:
                g.kill()
    finally:
        pool.remove()


def _alive(pid: int) -> bool:
    """Whether a local process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_respawn_replaces_a_killed_and_a_stopped_worker_in_their_slots(ray_session):
    """A dead member and a hung one (SIGSTOP: it never answers) are replaced by fresh processes in the
    same slots; the old processes are gone, the new ones start from nothing and answer."""
    import signal

    from toy_workers import EchoWorker

    pool = ResourcePool([2], use_gpu=False, name="respawned")
    group = RayWorkerGroup(pool, EchoWorker, name="phoenix", timeout_s=120)
    try:
        first = list(group.pids)
        assert [i["pid"] for i in group.whoami()] == first
        group.actor_step(Batch({"idx": torch.arange(4)}))  # state the replacements must not have
        with pytest.raises(WorkerDiedError):
            group.die_on(1)
        assert group.respawn() == first
        second = list(group.pids)
        assert not set(second) & set(first) and not any(_alive(p) for p in first)
        assert [(i["rank"], i["world"]) for i in group.whoami()] == [(0, 2), (1, 2)]
        assert group.history() == [[], []]

        os.kill(second[0], signal.SIGSTOP)
        group.timeout_s = 2
        with pytest.raises(WorkerTimeoutError, match=r"rank\(s\) \[0\]"):
            group.whoami()
        group.timeout_s = 120
        assert group.respawn() == second and group.generation == 2
        assert not any(_alive(p) for p in second)
        assert [i["pid"] for i in group.whoami()] == group.pids
    finally:
        group.kill()
        pool.remove()
