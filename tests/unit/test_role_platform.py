"""Debian 12 only: every entry point that changes a host refuses any other platform first.

The roles were only ever run on Debian 12 (bookworm): the kernel packages are Debian's, the
trial boot drives Debian's GRUB, the post-checks install rt-tests with apt. Each entry point
that changes a host starts with the host role's `platform` entry point, which refuses any
other distribution in one line before anything changes. Run here by ansible-playbook
against localhost, in check mode, with the distribution's facts faked (set_fact, cacheable,
in the in-memory fact cache), so nothing on this machine changes even where a check is
missing.
"""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import REPO, run_local_playbook

# Entry points that change a host, and the read-only first steps of those (preflight of
# main, rollback_check of rollback): each refuses another platform before anything else.
CHANGES_A_HOST = {
    "rtfleet_host": ["main", "preflight", "verify", "rollback_check", "rollback", "restore"],
    "rtfleet_kubelet": ["main", "node", "rollback", "restore"],
    "rtfleet_runtime": ["main", "rollback", "remove"],
    "rtfleet_postcheck": ["main"],
    "rtfleet_sampler": ["main", "remove"],
}
# Read-only on any host (assess previews the plan of any host) or on the controller only.
ANY_HOST = {
    "rtfleet_host": ["plan", "platform", "read_plan"],
    "rtfleet_runtime": ["bundle"],
    "rtfleet_postcheck": ["report", "refused", "stopped"],
}
REFUSAL = "Refuse a distribution rtfleet does not run on"
WRITE = "Write what stopped each entry point"
INCLUDE_TASKS = ("ansible.builtin.import_tasks", "ansible.builtin.include_tasks")
UBUNTU = {
    "ansible_distribution": "Ubuntu",
    "ansible_distribution_version": "22.04",
    "ansible_distribution_major_version": "22",
    "ansible_distribution_release": "jammy",
    "ansible_os_family": "Debian",
}


def _facts(distribution, version, release, family):
    return {
        "ansible_distribution": distribution,
        "ansible_distribution_version": version,
        "ansible_distribution_major_version": version.split(".")[0],
        "ansible_distribution_release": release,
        "ansible_os_family": family,
    }


def _run(tmp_path, facts, entry_points):
    """Each (role, entry point) in its own block; what stopped it, per entry point."""
    out = tmp_path / "stopped.json"
    tasks = [{"ansible.builtin.set_fact": {**facts, "cacheable": True}}] if facts else []
    tasks.append({"ansible.builtin.set_fact": {"__stopped": {}}})
    for role, entry in entry_points:
        key = "%s/%s" % (role, entry)
        tasks.append(
            {
                "name": "Run %s" % key,
                "block": [
                    {
                        "ansible.builtin.include_role": {
                            "name": "rtfleet.fleet.%s" % role,
                            "tasks_from": entry,
                        }
                    },
                    {
                        "ansible.builtin.set_fact": {
                            "__stopped": "{{ __stopped | combine({%r: None}) }}" % key
                        }
                    },
                ],
                "rescue": [
                    {
                        "ansible.builtin.set_fact": {
                            "__stopped": "{{ __stopped | combine({%r: {"
                            "'task': ansible_failed_task.name,"
                            " 'msg': ansible_failed_result.msg | default('')}}) }}" % key
                        }
                    }
                ],
            }
        )
    tasks.append(
        {
            "name": WRITE,
            "ansible.builtin.copy": {"dest": str(out), "content": "{{ __stopped | to_json }}"},
            "check_mode": False,
        }
    )
    playbook = tmp_path / "platform.yml"
    playbook.write_text(
        yaml.safe_dump([{"hosts": "localhost", "gather_facts": False, "tasks": tasks}])
    )
    run = run_local_playbook(
        playbook,
        "--check",
        ANSIBLE_STDOUT_CALLBACK="json",
        ANSIBLE_CACHE_PLUGIN="memory",
        # Where a check is missing, what runs next finds no records of this test's making.
        RTFLEET_REPORT_DIR=str(tmp_path / "reports"),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    changed = [
        task["task"]["name"]
        for play in json.loads(run.stdout)["plays"]
        for task in play["tasks"]
        if task["hosts"].get("localhost", {}).get("changed") and task["task"]["name"] != WRITE
    ]
    return json.loads(out.read_text()), changed


def test_every_entry_point_is_classified():
    for role in sorted((REPO / "roles").iterdir()):
        specs = yaml.safe_load((role / "meta/argument_specs.yml").read_text())["argument_specs"]
        classified = CHANGES_A_HOST.get(role.name, []) + ANY_HOST.get(role.name, [])
        assert sorted(classified) == sorted(specs), role.name


def _flat(role, entry):
    """The tasks an entry point runs first, its role's own task files followed in order."""
    for task in yaml.safe_load((REPO / "roles" / role / "tasks" / ("%s.yml" % entry)).read_text()):
        include = [task[k] for k in INCLUDE_TASKS if k in task]
        if include:
            yield from _flat(role, include[0][: -len(".yml")])
        else:
            yield task


@pytest.mark.parametrize(
    ("role", "entry"), [(r, e) for r, entries in CHANGES_A_HOST.items() for e in entries]
)
def test_the_platform_check_comes_first(role, entry):
    first = next(_flat(role, entry))
    if role == "rtfleet_host":
        assert first["name"] == next(_flat("rtfleet_host", "platform"))["name"]
    else:
        assert first.get("ansible.builtin.include_role") == {
            "name": "rtfleet.fleet.rtfleet_host",
            "tasks_from": "platform",
        }, first


def test_every_entry_point_that_changes_a_host_refuses_ubuntu_in_one_line(tmp_path):
    entries = [(r, e) for r, es in CHANGES_A_HOST.items() for e in es]
    stopped, changed = _run(tmp_path, UBUNTU, entries)
    assert changed == []
    for role, entry in entries:
        what = stopped["%s/%s" % (role, entry)]
        assert what is not None, "%s/%s ran to its end on Ubuntu" % (role, entry)
        assert what["task"].endswith(REFUSAL), (role, entry, what)
        assert what["msg"] == (
            "localhost runs Ubuntu 22.04 (jammy); rtfleet runs on Debian bookworm only."
            " Nothing was changed."
        )


@pytest.mark.parametrize(
    "facts",
    [
        _facts("Debian", "11.9", "bullseye", "Debian"),
        _facts("Debian", "13.1", "trixie", "Debian"),
        _facts("RedHat", "9.4", "Plow", "RedHat"),
        _facts("Rocky", "9.4", "Blue Onyx", "RedHat"),
    ],
    ids=lambda f: f["ansible_distribution_release"],
)
def test_other_platforms_are_refused(tmp_path, facts):
    stopped, changed = _run(tmp_path, facts, [("rtfleet_host", "platform")])
    assert changed == []
    assert stopped["rtfleet_host/platform"]["task"].endswith(REFUSAL)
    assert "\n" not in stopped["rtfleet_host/platform"]["msg"]


def test_debian_12_passes_faked_and_as_gathered(tmp_path):
    # Without faked facts the check gathers this machine's: the lab controller is Debian 12.
    for facts in (_facts("Debian", "12.11", "bookworm", "Debian"), None):
        stopped, changed = _run(tmp_path, facts, [("rtfleet_host", "platform")])
        assert stopped == {"rtfleet_host/platform": None} and changed == []


def test_every_role_lists_the_platforms_the_check_allows():
    allowed = yaml.safe_load((REPO / "roles/rtfleet_host/vars/main.yml").read_text())[
        "__rtfleet_host_platforms"
    ]
    for role in sorted((REPO / "roles").iterdir()):
        meta = yaml.safe_load((role / "meta/main.yml").read_text())
        assert meta["galaxy_info"]["platforms"] == allowed, role.name
    assert not (REPO / "roles/rtfleet_host/vars/RedHat.yml").exists()
