"""Every `agent_name` of the data is checked against the run's agent loops at start-up, over all rows
(the first row naming each is kept with its file), so a bad row is named before any worker starts
instead of failing the step that draws it."""

from types import SimpleNamespace

from ballast.data import RLDataset, write_jsonl
from ballast.models import load_tokenizer, tiny_model_dir
from ballast.trainer.run.preflight import unknown_agent_name
from ballast.workers.agent_loop.config import AgentLoopSpec


def _row(i, agent_name=None):
    row = {"data_source": "d", "prompt": [{"role": "user", "content": f"q{i}"}], "reward_model": {"ground_truth": "a"}}
    return row if agent_name is None else {**row, "agent_name": agent_name}


def _plan(agent, rollout_agent=None):
    rollout = None if rollout_agent is None else SimpleNamespace(agent=rollout_agent)
    return SimpleNamespace(specs=SimpleNamespace(actor_rollout_ref=SimpleNamespace(agent=agent), rollout=rollout))


def test_the_first_row_naming_each_agent_loop_is_kept_with_its_file(tmp_path):
    first = write_jsonl([_row(0), _row(1, "tool_agent"), _row(2, "tool_agent")], tmp_path / "a.jsonl")
    second = write_jsonl([_row(0), _row(1), _row(2, "mine")], tmp_path / "b.jsonl")
    data = RLDataset([first, second], load_tokenizer(tiny_model_dir("tiny")), max_prompt_length=64)
    assert data.agent_names == {"tool_agent": f"data file {str(first)!r} row 1", "mine": f"data file {str(second)!r} row 2"}


def test_an_unknown_agent_name_is_named_with_its_file_and_row():
    spec = AgentLoopSpec(tokenizer_path="/t", prompt_length=8)
    names = {"tool_agent": "data file 'a.jsonl' row 1", "mine": "data file 'b.jsonl' row 2"}
    problem = unknown_agent_name(_plan(spec), names)
    assert problem.startswith("data file 'b.jsonl' row 2: agent_name='mine' is not an agent loop; registered: [")
    assert "agent_loop_config_path adds loops" in problem
    assert unknown_agent_name(_plan(spec), {"tool_agent": "x"}) is None
    assert unknown_agent_name(_plan(None, rollout_agent=spec), names) == problem  # the rollout pool's loops
    assert unknown_agent_name(_plan(None), names) is None  # no rollout role anywhere: no agent_name is read
