"""The collection's shape: one plan computation, self-contained roles, FQCN names.

Read from the files themselves, so a later change that computes a plan in another role,
reaches outside a role or calls a module by a short name fails here before a VM boots.
"""

from __future__ import annotations

import re

import yaml
from conftest import REPO

YAML_DIRS = ("roles", "playbooks", "molecule")
OWN_MODULES = sorted(p.stem for p in (REPO / "plugins/modules").glob("*.py"))


def _files(*suffixes):
    for top in YAML_DIRS:
        for path in sorted((REPO / top).rglob("*")):
            if path.is_file() and path.suffix in suffixes:
                yield path


def test_the_plan_is_computed_in_the_host_roles_plan_task_only():
    computing = [
        str(p.relative_to(REPO))
        for p in _files(".yml", ".j2")
        if re.search(r"\|\s*rtfleet\.fleet\.plan\b|\brtfleet_plan\(", p.read_text())
    ]
    assert computing == ["roles/rtfleet_host/tasks/plan.yml"]


def test_roles_reach_nothing_outside_themselves():
    outside = [
        str(p.relative_to(REPO))
        for p in (REPO / "roles").rglob("*")
        if p.is_file()
        and p.suffix in (".yml", ".j2")
        and re.search(r"role_path[^}]*\.\./", p.read_text())
    ]
    assert outside == []


def _tasks(node):
    if isinstance(node, list):
        for item in node:
            yield from _tasks(item)
    elif isinstance(node, dict):
        yield node
        for key in ("block", "rescue", "always", "tasks", "pre_tasks", "post_tasks", "handlers"):
            if key in node:
                yield from _tasks(node[key])


def test_own_modules_and_roles_are_called_by_their_full_names():
    short = []
    for path in _files(".yml"):
        try:
            doc = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            continue
        for task in _tasks(doc):
            for key in task:
                if key in OWN_MODULES:
                    short.append("%s: %s" % (path.relative_to(REPO), key))
            for key in ("ansible.builtin.include_role", "ansible.builtin.import_role"):
                name = (
                    (task.get(key) or {}).get("name", "") if isinstance(task.get(key), dict) else ""
                )
                if name.startswith("rtfleet_"):
                    short.append("%s: role %s" % (path.relative_to(REPO), name))
            for role in task.get("roles", []) if isinstance(task.get("roles"), list) else []:
                name = role.get("role", "") if isinstance(role, dict) else role
                if str(name).startswith("rtfleet_"):
                    short.append("%s: role %s" % (path.relative_to(REPO), name))
    assert short == []


def test_every_role_documents_its_entry_points_and_every_tasks_from_has_a_spec():
    for role in sorted((REPO / "roles").iterdir()):
        specs = yaml.safe_load((role / "meta/argument_specs.yml").read_text())["argument_specs"]
        used = set()
        for path in _files(".yml"):
            used |= set(
                re.findall(
                    r"name: rtfleet\.fleet\.%s\n\s+tasks_from: (\w+)" % role.name, path.read_text()
                )
            )
        assert used <= set(specs), (role.name, sorted(used - set(specs)))
        assert "main" in specs
