"""rtfleet_runtime and rtfleet_postcheck refuse bad input before anything changes.

The real roles run through ansible-playbook against localhost. Every case here must fail
in the roles' first (read-only) tasks, with a message that says what to change, and leave
a marker directory untouched: the runtime role would create its prefix and data dirs.
"""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import run_local_playbook

from rtfleet.plan_record import to_record
from rtfleet.planner import plan_partition
from rtfleet.topology import read_topology


def _run(tmp_path, role, **role_vars):
    play = [
        {
            "name": "Apply %s" % role,
            "hosts": "localhost",
            "gather_facts": False,
            "tasks": [
                {
                    "ansible.builtin.include_role": {"name": "rtfleet.fleet." + role},
                    "vars": role_vars,
                }
            ],
        }
    ]
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump(play))
    run = run_local_playbook(playbook, ANSIBLE_STDOUT_CALLBACK="json")
    for play_out in json.loads(run.stdout)["plays"]:
        for task in play_out["tasks"]:
            result = task["hosts"].get("localhost", {})
            if result.get("failed"):
                return run, task["task"]["name"], result["msg"]
    return run, None, None


@pytest.fixture
def runtime_dirs(tmp_path):
    """Role variables that point every path the runtime role would write into tmp_path."""
    return {
        "rtfleet_runtime_prefix": str(tmp_path / "opt"),
        "rtfleet_runtime_data_dir": str(tmp_path / "data"),
        "rtfleet_runtime_wheelhouse": str(tmp_path / "wheelhouse"),
    }


def _nothing_written(tmp_path):
    return not any((tmp_path / d).exists() for d in ("opt", "data", "wheelhouse"))


def _plan_file(tmp_path, trees, shape, policy):
    plan = plan_partition(read_topology(str(trees(shape))), policy)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(to_record(plan)))
    return path, plan


def test_runtime_refuses_a_host_without_a_plan(tmp_path, runtime_dirs):
    run, task, msg = _run(
        tmp_path,
        "rtfleet_runtime",
        rtfleet_host_plan_file=str(tmp_path / "missing.json"),
        **runtime_dirs,
    )
    assert run.returncode != 0
    assert "is missing" in msg and "playbooks/host.yml" in msg, (task, msg)
    assert _nothing_written(tmp_path)


def test_runtime_refuses_a_plan_without_runtime_groups(tmp_path, trees, runtime_dirs):
    path, plan = _plan_file(tmp_path, trees, "epyc-9634-2s", {"runtime_l3_groups": 0})
    assert plan["runtime_groups"] == []
    run, task, msg = _run(
        tmp_path, "rtfleet_runtime", rtfleet_host_plan_file=str(path), **runtime_dirs
    )
    assert run.returncode != 0
    assert "no runtime group" in msg and "runtime_l3_groups" in msg, (task, msg)
    assert _nothing_written(tmp_path)


def test_runtime_refuses_a_plan_record_of_another_schema(tmp_path, trees, runtime_dirs):
    path, plan = _plan_file(tmp_path, trees, "epyc-9634-2s", {})
    path.write_text(json.dumps({**to_record(plan), "schema": 3}))
    run, task, msg = _run(
        tmp_path, "rtfleet_runtime", rtfleet_host_plan_file=str(path), **runtime_dirs
    )
    assert run.returncode != 0
    assert task.endswith("Stop on a plan record this collection cannot use"), (task, msg)
    assert msg.startswith(
        f"cannot use {path}: plan schema 3 is not one this collection reads (1, 2)"
    )
    assert "re-run the host step" in msg
    assert _nothing_written(tmp_path)


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({"rtfleet_runtime_rt_priority": 99}, "rtfleet_runtime_rt_priority must be 1..98"),
        ({"rtfleet_runtime_model_src": "/nonexistent/models"}, "empty or a directory"),
        ({"rtfleet_runtime_memory_max_per_worker_mib": 16}, "at least 128 (got 16)"),
        ({"rtfleet_runtime_tasks_max_per_worker": 2}, "at least 8 (got 2)"),
        ({"rtfleet_runtime_limit_nofile": 256}, "at least 1024 (got 256)"),
        ({"rtfleet_runtime_backend": "tensorrt"}, "rtfleet_runtime_backend"),
    ],
)
def test_runtime_refuses_bad_settings(tmp_path, trees, runtime_dirs, variables, expected):
    path, _ = _plan_file(tmp_path, trees, "epyc-9634-2s", {})
    run, task, msg = _run(
        tmp_path,
        "rtfleet_runtime",
        rtfleet_host_plan_file=str(path),
        **runtime_dirs,
        **variables,
    )
    assert run.returncode != 0
    assert expected in msg, (task, msg)
    assert _nothing_written(tmp_path)


def test_postcheck_refuses_a_tuned_host_without_the_host_records(tmp_path):
    results = tmp_path / "results"
    run, task, msg = _run(
        tmp_path,
        "rtfleet_postcheck",
        rtfleet_postcheck_results_dir=str(results),
    )
    assert run.returncode != 0
    assert "plan.json or host.json is missing" in msg and "kind=baseline" in msg, (task, msg)
    assert not results.exists()
