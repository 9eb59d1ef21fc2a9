"""The adaptive policy's rules (edge_client.policy): the step rule's schedule on its own, and either rule
inside the Tuner on the virtual-clock timeline (tools/testkit/timeline.py), where the fallback (speculation
off, probes) is the Tuner's and the same for both."""

import pytest

from edge_client.adaptive import Tuner, TunerConfig
from edge_client.policy import ModelRule, StepRule
from tools.testkit import timeline

MS = 1e-3
COSTS = timeline.Costs(8.5 * MS, 6.0 * MS, 17 * MS, 2.1 * MS, 1.5 * MS, jitter=0.1)  # SmolLM2's on the rig


class Held:
    """What a rule sees of its Tuner, for the step rule (which reads none of it but `moves`)."""

    moves = 0


def test_the_step_rule_adds_two_after_a_round_all_accepted_and_takes_one_after_a_rejection():
    rule, tuner = StepRule(gamma=4, depth=2), Held()
    rule.observe(4, 4, cut=False)
    assert rule.choose(tuner, range(1, 9), range(0, 4), (4, 2)) == (6, 2) and tuner.moves == 1
    rule.observe(6, 2, cut=False)
    assert rule.choose(tuner, range(1, 9), range(0, 4), (6, 2)) == (5, 2)
    rule.observe(5, 3, cut=True)  # a finish cut the round: no rejection to learn from
    assert rule.choose(tuner, range(1, 9), range(0, 4), (5, 2)) == (5, 2) and tuner.moves == 2
    for _ in range(9):
        rule.observe(1, 0, cut=False)
    assert rule.choose(tuner, range(1, 9), range(0, 4), (5, 2)) == (1, 2)  # never below 1


def test_the_step_rule_keeps_to_the_caps_and_its_depth_to_the_range_allowed():
    rule = StepRule(gamma=7, depth=2)
    for _ in range(5):
        rule.observe(7, 7, cut=False)
    assert rule.choose(Held(), range(1, 9), range(0, 1), (7, 0)) == (8, 0)
    rule.observe(8, 3, cut=False)  # from the cap, not from the 17 it would have counted to
    assert rule.choose(Held(), range(1, 9), range(0, 4), (8, 0)) == (7, 2)


def test_the_config_names_the_rule():
    assert isinstance(Tuner().rule, ModelRule)
    step = Tuner(TunerConfig(rule="step", initial=(3, 1))).rule
    assert isinstance(step, StepRule) and (step.gamma, step.depth) == (3, 1)


@pytest.mark.parametrize("rule", ["model", "step"])
def test_either_rule_turns_speculation_off_for_a_wrong_draft_and_keeps_it_on_for_a_right_one(rule):
    """The fallback is the Tuner's: a draft wrong 95 % of the time turns speculation off whichever rule
    chooses γ; one right 95 % of the time never does, and the step rule climbs to the largest γ."""
    wrong = Tuner(TunerConfig(rule=rule))
    timeline.tokens_per_second(COSTS, 0.05, None, None, 600, tuner=wrong)
    assert wrong.offs >= 1 and wrong.plain_steps > 0
    right = Tuner(TunerConfig(rule=rule))
    timeline.tokens_per_second(COSTS, 0.95, None, None, 600, tuner=right)
    assert right.offs == 0 and right.state == "on"
    if rule == "step":
        assert max(g for _, g, _ in right.path) == right.config.max_gamma
