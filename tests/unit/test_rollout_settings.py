"""plugins/module_utils/rollout.py: the rollout's batch plan and the gate after each batch."""

from __future__ import annotations

import pytest

from ansible_collections.rtfleet.fleet.plugins.module_utils.rollout import (
    RolloutError,
    batch_verdict,
    decide,
    decided,
)


def test_unset_settings_are_the_canary():
    plan = decide({"b": {}, "a": {}})
    assert plan == {"hosts": ["a", "b"], "serial": [1, "10%", "100%"], "max_fail_percentage": 0}


def test_numbers_written_as_text_are_numbers():
    plan = decide({"a": {"rtfleet_serial": "2", "rtfleet_max_fail_percentage": "50"}})
    assert plan["serial"] == 2 and plan["max_fail_percentage"] == 50
    assert decide({"a": {"rtfleet_serial": ["1", "25%"]}})["serial"] == [1, "25%"]


@pytest.mark.parametrize(
    "own",
    [
        {"rtfleet_serial": 0},
        {"rtfleet_serial": "0%"},
        {"rtfleet_serial": "101%"},
        {"rtfleet_serial": []},
        {"rtfleet_serial": True},
        {"rtfleet_serial": [1, "x"]},
        {"rtfleet_max_fail_percentage": 101},
        {"rtfleet_max_fail_percentage": -1},
        {"rtfleet_max_fail_percentage": "50%"},
    ],
)
def test_bad_settings_are_one_line(own):
    with pytest.raises(RolloutError) as err:
        decide({"a": own})
    assert "\n" not in str(err.value) and "rtfleet_serial must be" in str(err.value)


def test_hosts_that_disagree_are_named():
    hosts = {"h%d" % i: {"rtfleet_serial": 1} for i in range(10)}
    hosts["odd"] = {"rtfleet_serial": 2}
    with pytest.raises(
        RolloutError, match=r"disagree on rtfleet_serial: 1 on h0, h1, h2, h3 and 6 more; 2 on odd"
    ):
        decide(hosts)


def test_no_host_is_an_error():
    with pytest.raises(RolloutError, match="no targeted host"):
        decide({})


def test_a_missing_decision_is_never_a_default():
    with pytest.raises(RolloutError, match="not decided"):
        decided(None, "serial")
    with pytest.raises(RolloutError, match="not decided"):
        decided({"hosts": []}, "serial")
    assert decided({"serial": 3}, "serial") == 3


@pytest.mark.parametrize(
    ("batch", "survivors", "limit", "stop"),
    [
        (["a", "b"], ["a", "b"], 0, False),
        (["a", "b"], ["b"], 0, True),
        (["a", "b"], ["b"], 50, False),
        (["a", "b", "c"], ["c"], 50, True),
        (["a"], [], 100, False),
    ],
)
def test_batch_verdict(batch, survivors, limit, stop):
    verdict = batch_verdict(batch, survivors, limit)
    assert verdict["stop"] is stop
    assert verdict["lost"] == [h for h in batch if h not in survivors]
    assert ("The rollout stops here" in verdict["message"]) is stop
