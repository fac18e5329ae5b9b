"""Launch-time failures: a Ray address where nothing answers fails within ray_init.timeout_s naming the
address; every error that ends a run maps to its exit code and one line; secrets never reach the
config dump."""

import json
import socket
import time

import pytest

from ballast.single_controller import PlacementError, WorkerDiedError, WorkerError, WorkerTimeoutError
from ballast.trainer.config import ConfigError
from ballast.trainer.main import (
    EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_RAY_UNAVAILABLE, EXIT_WORKER_FAILED, InputError, RayUnavailableError, failure,
    probe_ray_address,
)
from ballast.trainer.ray_trainer import DynamicSamplingError, NonFiniteStepsError
from ballast.trainer.run.tracking import Tracker


def _closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_nothing_listening_fails_within_the_timeout_naming_the_address():
    port = _closed_port()
    start = time.monotonic()
    with pytest.raises(RayUnavailableError, match=rf"ray_init\.address='127\.0\.0\.1:{port}': nothing answered at "
                                                  rf"127\.0\.0\.1:{port} within 1\.5s \(ray_init\.timeout_s\)"):
        probe_ray_address(f"127.0.0.1:{port}", timeout_s=1.5)
    assert time.monotonic() - start < 3.0


def test_a_listening_address_passes_at_once_with_or_without_a_scheme():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        port = server.getsockname()[1]
        start = time.monotonic()
        probe_ray_address(f"127.0.0.1:{port}", timeout_s=5)
        probe_ray_address(f"ray://127.0.0.1:{port}", timeout_s=5)
        assert time.monotonic() - start < 1.0


def test_auto_uses_ray_address_from_the_environment(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    probe_ray_address("auto", timeout_s=0.5)  # Ray resolves the local session itself
    port = _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(RayUnavailableError, match=f"127.0.0.1:{port}"):
        probe_ray_address("auto", timeout_s=0.5)


@pytest.mark.parametrize("address", ["headnode", "10.0.0.1:", ":6379", "10.0.0.1:port"])
def test_malformed_address_is_a_config_error(address):
    with pytest.raises(ConfigError, match=rf"ray_init\.address='{address}' must be 'auto', host:port or ray://host:port"):
        probe_ray_address(address, timeout_s=1)


REMOTE_TRACEBACK = ("actor_rollout_ref.update_actor failed on worker rank 1:\nray::Worker._ballast_call()\n"
                    "  File \"engine.py\", line 3, in step\nRuntimeError: CUDA out of memory")


@pytest.mark.parametrize("err, code, line", [
    (ConfigError("data.train_batch_size=3 is not divisible"), EXIT_BAD_INPUT,
     "invalid config: data.train_batch_size=3 is not divisible"),
    (InputError("data file '/d.parquet' row 2: field 'prompt' is missing"), EXIT_BAD_INPUT,
     "invalid input: data file '/d.parquet' row 2: field 'prompt' is missing"),
    (WorkerDiedError("g.update_actor: worker rank 1 died (ActorDiedError): The actor died.\n\tpid: 12"),
     EXIT_WORKER_FAILED, "worker failure: g.update_actor: worker rank 1 died (ActorDiedError): The actor died."),
    (WorkerTimeoutError("g.generate_sequences: worker rank(s) [0] did not finish within 60s"), EXIT_WORKER_FAILED,
     "worker failure: g.generate_sequences: worker rank(s) [0] did not finish within 60s"),
    (WorkerError(REMOTE_TRACEBACK), EXIT_WORKER_FAILED,
     "worker failure: actor_rollout_ref.update_actor failed on worker rank 1: RuntimeError: CUDA out of memory"),
    (NonFiniteStepsError("5 actor updates in a row had a non-finite gradient norm"), EXIT_NONFINITE,
     "training stopped: 5 actor updates in a row had a non-finite gradient norm"),
    (DynamicSamplingError("algorithm.filter_groups: 4 generation batches (max_num_gen_batches=4) gave only 1"),
     EXIT_NONFINITE, "training stopped: algorithm.filter_groups: 4 generation batches (max_num_gen_batches=4) gave only 1"),
    (RayUnavailableError("the local Ray instance did not start: The current node timed out during startup."),
     EXIT_RAY_UNAVAILABLE, "ray cluster: the local Ray instance did not start: The current node timed out during startup."),
    (PlacementError("resource pool 'p' needs 2 node(s)"), EXIT_RAY_UNAVAILABLE,
     "ray cluster: resource pool 'p' needs 2 node(s)"),
    (RayUnavailableError("ray_init.address='h:1': nothing answered"), EXIT_RAY_UNAVAILABLE,
     "ray cluster: ray_init.address='h:1': nothing answered"),
    (KeyError("surprise"), 1, "KeyError: 'surprise'"),
    # what Ray's memory monitor raises from ray.get on the driver (seen on a machine short of memory)
    (__import__("ray.exceptions").exceptions.OutOfMemoryError(
        "2 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 192.0.2.2) was "
        "22.28GB used / 23.54GB limit (0.946275)\nOOM kill reason: ..."), EXIT_WORKER_FAILED,
     "worker failure: out of memory: 2 worker(s) were killed due to the node running low on memory. Memory on the "
     "node (IP: 192.0.2.2) was 22.28GB used / 23.54GB limit (0.946275)"),
])
def test_every_fatal_error_has_an_exit_code_and_one_line(err, code, line):
    assert failure(err) == (code, line)


def test_secret_looking_config_values_are_redacted_in_the_config_dump(tmp_path):
    config = {"trainer": {"project_name": "p", "wandb_api_key": "wk-123-secret"},
              "custom": {"hf_token": "hf_abc_secret", "db": {"password": "pw-secret"}, "auth": ["bearer-secret"]},
              "list": [{"api_secret": "s-secret"}]}
    tracker = Tracker([], "p", "e", str(tmp_path), config=config)
    tracker.finish()
    text = (tmp_path / "config.json").read_text()
    assert "secret" not in text.replace("api_secret", ""), text
    dumped = json.loads(text)
    assert dumped["trainer"] == {"project_name": "p", "wandb_api_key": "***"}
    assert dumped["custom"]["hf_token"] == "***" and dumped["list"][0]["api_secret"] == "***"


def test_every_way_a_run_ends_has_its_exit_code_and_last_line():
    from ballast.trainer.run import signals
    from ballast.trainer.main import outcome

    assert outcome(None) == (0, "")
    assert outcome(KeyboardInterrupt()) == (130, "interrupted")
    assert outcome(signals.Terminated()) == (143, "terminated")
    assert outcome(ConfigError("x")) == (EXIT_BAD_INPUT, "invalid config: x")
