"""Bad inputs through the command-line path (`cli_run`, what `python -m ballast.trainer.main` runs):
each ends with exit code 2 or 5 and one line naming the key, file, row or value, before any step runs
and without hanging. The table in docs/reliability.md lists these cases with their messages."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from ballast.data import write_jsonl
from ballast.trainer.config import compose
from ballast.trainer.main import EXIT_RAY_UNAVAILABLE, cli_run

from testkit.e2e import overrides


def _row(content, index=0, **fields):
    row = {"data_source": "ballast/repeat", "prompt": [{"role": "user", "content": content}],
           "reward_model": {"style": "rule", "ground_truth": "##"}, "extra_info": {"index": index}}
    row.update(fields)
    return row


def _closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


@pytest.fixture(scope="module")
def bad(tiny_task, tmp_path_factory):
    """Paths of broken files and directories, keyed by name."""
    root = tmp_path_factory.mktemp("bad_inputs")
    good = [_row("Repeat # twice.", i) for i in range(8)]
    paths = {"missing": str(root / "missing.parquet")}
    (root / "corrupt.parquet").write_bytes(b"PAR1 not really parquet")
    (root / "broken.jsonl").write_text(json.dumps(good[0]) + "\n{oops\n")
    (root / "rows.csv").write_text("prompt,answer\nhi,1\n")
    (root / "empty.jsonl").write_text("")
    variants = {
        "no_prompt": {k: v for k, v in _row("x", 5).items() if k != "prompt"},
        "empty_prompt": _row("x", 5, prompt="   "),
        "int_prompt": _row("x", 5, prompt=42),
        "int_content": _row("x", 5, prompt=[{"role": "user", "content": 7}]),
        "long_prompt": _row("# " * 200, 5),
        "no_truth": _row("x", 5, reward_model={"style": "rule"}),
        "bad_agent": _row("x", 5, agent_name="no_such_loop"),
    }
    for name, row in variants.items():
        write_jsonl(good[:5] + [row] + good[6:], root / f"{name}.jsonl")
    write_jsonl(good[:2], root / "two_rows.jsonl")
    for name in ("corrupt.parquet", "broken.jsonl", "rows.csv", "empty.jsonl", "two_rows.jsonl"):
        paths[name.split(".")[0]] = str(root / name)
    paths.update({name: str(root / f"{name}.jsonl") for name in variants})
    model = tiny_task["model"]
    (root / "no_tokenizer").mkdir()
    shutil.copy(os.path.join(model, "config.json"), root / "no_tokenizer" / "config.json")
    shutil.copytree(model, root / "no_eos")
    cfg = json.loads((root / "no_eos" / "tokenizer_config.json").read_text())
    cfg["eos_token"] = None
    (root / "no_eos" / "tokenizer_config.json").write_text(json.dumps(cfg))
    (root / "bad_json_model").mkdir()
    (root / "bad_json_model" / "config.json").write_text("{truncated")
    (root / "reward_other_name.py").write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                               "    return 0.0\n")
    (root / "reward_syntax.py").write_text("def compute_score(:\n")
    for name in ("no_tokenizer", "no_eos", "bad_json_model", "reward_other_name.py", "reward_syntax.py"):
        paths[name.split(".")[0]] = str(root / name)
    (root / "broken_tools.yaml").write_text("tools:\n  - class_name: testkit.broken_tools.UnreachableServiceTool\n")
    paths["broken_tools"] = str(root / "broken_tools.yaml")
    paths["missing_model"] = str(root / "no_such_model")
    paths["missing_reward"] = str(root / "no_such_reward.py")
    return paths


# (id, extra overrides given the bad paths, exit code, fragment of the last stderr line)
CASES = [
    ("train file missing", lambda p: [f"data.train_files={p['missing']}"], 2, r"data file '.*missing\.parquet' does not exist"),
    ("corrupt parquet", lambda p: [f"data.train_files={p['corrupt']}"], 2, r"corrupt\.parquet' is not a readable parquet file"),
    ("invalid JSON line", lambda p: [f"data.train_files={p['broken']}"], 2, r"broken\.jsonl' line 2: invalid JSON"),
    ("unsupported file type", lambda p: [f"data.train_files={p['rows']}"], 2, r"rows\.csv': unsupported data file type"),
    ("empty data file", lambda p: [f"data.train_files={p['empty']}"], 2,
     r"no prompts in data file\(s\) \['.*empty\.jsonl'\]: the file\(s\) hold no rows"),
    ("fewer rows than a batch", lambda p: [f"data.train_files={p['two_rows']}"], 2,
     r"dataset has 2 samples < batch_size=4 .*data\.train_batch_size"),
    ("row without prompt", lambda p: [f"data.train_files={p['no_prompt']}"], 2, r"no_prompt\.jsonl' row 5: field 'prompt' is missing"),
    ("empty prompt", lambda p: [f"data.train_files={p['empty_prompt']}"], 2, r"row 5: field 'prompt' is an empty string"),
    ("prompt not text", lambda p: [f"data.train_files={p['int_prompt']}"], 2,
     r"row 5: field 'prompt' must be a non-empty list of chat messages, got 42"),
    ("message content not a string", lambda p: [f"data.train_files={p['int_content']}"], 2,
     r"row 5: field 'prompt\[0\]\.content' must be a string, got int"),
    ("prompt longer than the limit", lambda p: [f"data.train_files={p['long_prompt']}"], 2,
     r"long_prompt\.jsonl' row 5: prompt has \d+ tokens > max_prompt_length=32"),
    ("no ground truth", lambda p: [f"data.train_files={p['no_truth']}"], 2, r"row 5: field 'reward_model\.ground_truth' is missing"),
    ("model path missing", lambda p: [f"actor_rollout_ref.model.path={p['missing_model']}"], 2,
     r"actor_rollout_ref\.model\.path='.*no_such_model': not a directory"),
    ("model config unreadable", lambda p: [f"actor_rollout_ref.model.path={p['bad_json_model']}"], 2,
     r"bad_json_model': cannot read config\.json"),
    ("model without tokenizer", lambda p: [f"actor_rollout_ref.model.path={p['no_tokenizer']}"], 2,
     r"no tokenizer in '.*no_tokenizer'"),
    ("tokenizer without eos", lambda p: [f"actor_rollout_ref.model.path={p['no_eos']}"], 2,
     r"the tokenizer in '.*no_eos' has no eos token"),
    ("reward file missing", lambda p: [f"custom_reward_function.path={p['missing_reward']}"], 2,
     r"custom reward file '.*no_such_reward\.py' does not exist"),
    ("reward function name missing", lambda p: [f"custom_reward_function.path={p['reward_other_name']}"], 2,
     r"reward_other_name\.py' has no function 'compute_score'; callables there: \['score'\]"),
    ("reward file does not import", lambda p: [f"custom_reward_function.path={p['reward_syntax']}"], 2,
     r"importing custom reward file '.*reward_syntax\.py' failed: SyntaxError"),
    ("agent_name not an agent loop", lambda p: [f"data.train_files={p['bad_agent']}", "actor_rollout_ref.rollout.mode=async"],
     2, r"invalid input: data file '.*bad_agent\.jsonl' row 5: agent_name='no_such_loop' is not an agent loop"),
    ("tool that cannot start", lambda p: ["actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.multi_turn.enable=true",
                                          f"actor_rollout_ref.rollout.multi_turn.tool_config_path={p['broken_tools']}"],
     2, r"tool_config_path: .*broken_tools\.yaml tools\[0\]: testkit\.broken_tools\.UnreachableServiceTool raised "
        r"ConnectionError while starting"),
    ("LoRA targets match no module", lambda p: ["actor_rollout_ref.model.lora_rank=4",
                                                "actor_rollout_ref.model.target_modules=[no_such_proj]"],
     2, r"actor_rollout_ref\.model\.target_modules: Target modules \{'no_such_proj'\} not found in the base model"),
    ("unknown key", lambda p: ["+trainer.wandb_api_key=abc"], 2, r"trainer\.wandb_api_key"),
    ("wrong type", lambda p: ["data.train_batch_size=four"], 2, r"data\.train_batch_size"),
    ("batch not divisible over workers", lambda p: ["data.train_batch_size=3", "actor_rollout_ref.rollout.n=3",
                                                  "actor_rollout_ref.actor.ppo_mini_batch_size=3"],
     2, r"not divisible by rollout dp size"),
    ("token budget below one sample", lambda p: ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40"], 2,
     r"ppo_max_token_len_per_gpu=40"),
    ("malformed Ray address", lambda p: ["ray_init.address=headnode"], 2, r"ray_init\.address='headnode' must be"),
    ("Ray address not answering", lambda p: [f"ray_init.address=127.0.0.1:{_closed_port()}", "ray_init.timeout_s=2"],
     5, r"ray_init\.address='127\.0\.0\.1:\d+': nothing answered at 127\.0\.0\.1:\d+ within 2s"),
]


def _cli(capsys, task, run_dir, extra):
    code = cli_run(compose(overrides(task, run_dir, *extra)))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    return code, lines


@pytest.mark.parametrize("name, extra, code, fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line_and_an_exit_code(name, extra, code, fragment, bad, tiny_task, tmp_path, capsys):
    start = time.monotonic()
    got, lines = _cli(capsys, tiny_task, str(tmp_path), extra(bad))
    assert got == code, lines[-20:]
    assert lines and lines[-1].startswith("ballast: "), lines[-20:]
    assert re.search(fragment, lines[-1]), lines[-1]
    assert not any(line.startswith("Traceback") for line in lines), "\n".join(lines)
    assert time.monotonic() - start < 30
    assert not os.path.exists(os.path.join(str(tmp_path), "workers.json")), "no worker may start on bad input"


def test_cluster_too_small_for_the_layout_fails_within_the_timeout(e2e_ray, tiny_task, tmp_path, capsys):
    extra = ["trainer.n_gpus_per_node=64", "data.train_batch_size=32", "actor_rollout_ref.rollout.n=2",
             "actor_rollout_ref.actor.ppo_mini_batch_size=32", "ray_init.timeout_s=2"]
    start = time.monotonic()
    code, lines = _cli(capsys, tiny_task, str(tmp_path), extra)
    assert code == EXIT_RAY_UNAVAILABLE, lines[-10:]
    assert re.search(r"ray cluster: resource pool .* needs 1 node\(s\) with \[64\] bundles of \{'CPU': 1\.0\}, but only 0 "
                     r"placement group\(s\) could be placed within 2s", lines[-1]), lines[-1]
    assert time.monotonic() - start < 30


def test_real_command_line_exit_code_and_last_line(tiny_task, tmp_path):
    """The hydra entry point itself: exit code 5 and the reason as the last line, no traceback."""
    extra = [f"ray_init.address=127.0.0.1:{_closed_port()}", "ray_init.timeout_s=3"]
    fragment = r"^ballast: ray cluster: ray_init\.address='127\.0\.0\.1:\d+': nothing answered .* within 3s"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ballast.trainer.main", *overrides(tiny_task, str(tmp_path), *extra)],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == EXIT_RAY_UNAVAILABLE, proc.stderr[-3000:]
    assert re.search(fragment, lines[-1]), lines[-1]
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start < 60
