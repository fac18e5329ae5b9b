"""The rollout fault-injection switch: what it accepts, and that a fault fires once, on its rank and
call only, and never in a replacement worker."""

import pytest

from ballast.workers.rollout.faults import ENV, GENERATION_ENV, Fault, FaultState, RolloutEngineError, armed


@pytest.mark.parametrize("value", ["explode@3", "kill@", "kill@x", "kill@3:one", "kill3"])
def test_a_value_naming_no_kind_or_call_is_refused_naming_the_variable(value):
    with pytest.raises(ValueError, match=ENV):
        armed({ENV: value})


def test_unset_is_off_and_the_rank_defaults_to_zero():
    assert armed({}) is None
    assert armed({ENV: "hang@4"}) == Fault("hang", 4, 0)
    assert armed({ENV: "kill@2:1"}) == Fault("kill", 2, 1)


def test_raise_fires_once_at_its_call_on_its_rank_and_not_in_a_replacement():
    env = {ENV: "raise@3:1"}
    FaultState(0, env).at_generate(3)  # another rank: nothing
    state = FaultState(1, env)
    state.at_generate(2)
    with pytest.raises(RolloutEngineError):
        state.at_generate(3)
    state.at_generate(3)  # the call run again in place: no second failure
    FaultState(1, {**env, GENERATION_ENV: "1"}).at_generate(3)  # a replacement worker: nothing
