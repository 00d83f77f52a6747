"""The collection's shape: one plan computation, self-contained roles, FQCN names.

Read from the files themselves, so a later change that computes a plan in another role,
reaches outside a role or calls a module by a short name fails here before a VM boots.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile

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


# Every link of the tree and the file it stands for. Each Python file has one home:
# plugins/module_utils for the collection's code (the CLI's package src/rtfleet, the host's
# package rtfleet_node and shminfer's topology readers link there), shminfer/ for the runtime (the
# runtime role ships it through its files/ link). Links point into a home, never out of one.
LINKS = {
    "roles/rtfleet_host/files/rtfleet_node/boot.py": "plugins/module_utils/boot.py",
    "roles/rtfleet_host/files/rtfleet_node/cpulist.py": "plugins/module_utils/cpulist.py",
    "roles/rtfleet_host/files/rtfleet_node/drift.py": "plugins/module_utils/drift.py",
    "roles/rtfleet_host/files/rtfleet_node/drift_checks.py": "plugins/module_utils/drift_checks.py",
    "roles/rtfleet_host/files/rtfleet_node/drift_host.py": "plugins/module_utils/drift_host.py",
    "roles/rtfleet_host/files/rtfleet_node/drift_units.py": "plugins/module_utils/drift_units.py",
    "roles/rtfleet_host/files/rtfleet_node/hosttune.py": "plugins/module_utils/hosttune.py",
    "roles/rtfleet_host/files/rtfleet_node/plan_record.py": "plugins/module_utils/plan_record.py",
    "roles/rtfleet_runtime/files/shminfer": "shminfer",
    "shminfer/src/shminfer/cpulist.py": "plugins/module_utils/cpulist.py",
    "shminfer/src/shminfer/hostfacts.py": "plugins/module_utils/hostfacts.py",
    "shminfer/src/shminfer/topology.py": "plugins/module_utils/topology.py",
    "src/rtfleet/boot.py": "plugins/module_utils/boot.py",
    "src/rtfleet/bundle.py": "plugins/module_utils/bundle.py",
    "src/rtfleet/checklist.py": "plugins/module_utils/checklist.py",
    "src/rtfleet/cpulist.py": "plugins/module_utils/cpulist.py",
    "src/rtfleet/drift.py": "plugins/module_utils/drift.py",
    "src/rtfleet/drift_checks.py": "plugins/module_utils/drift_checks.py",
    "src/rtfleet/drift_host.py": "plugins/module_utils/drift_host.py",
    "src/rtfleet/drift_units.py": "plugins/module_utils/drift_units.py",
    "src/rtfleet/hostfacts.py": "plugins/module_utils/hostfacts.py",
    "src/rtfleet/hosttune.py": "plugins/module_utils/hosttune.py",
    "src/rtfleet/kubelet.py": "plugins/module_utils/kubelet.py",
    "src/rtfleet/kubelet_options.py": "plugins/module_utils/kubelet_options.py",
    "src/rtfleet/kubelet_state.py": "plugins/module_utils/kubelet_state.py",
    "src/rtfleet/kubelet_validate.py": "plugins/module_utils/kubelet_validate.py",
    "src/rtfleet/kubelet_values.py": "plugins/module_utils/kubelet_values.py",
    "src/rtfleet/plan_record.py": "plugins/module_utils/plan_record.py",
    "src/rtfleet/planner.py": "plugins/module_utils/planner.py",
    "src/rtfleet/postcheck.py": "plugins/module_utils/postcheck.py",
    "src/rtfleet/postcheck_consistency.py": "plugins/module_utils/postcheck_consistency.py",
    "src/rtfleet/postcheck_gate.py": "plugins/module_utils/postcheck_gate.py",
    "src/rtfleet/postcheck_parse.py": "plugins/module_utils/postcheck_parse.py",
    "src/rtfleet/postcheck_result.py": "plugins/module_utils/postcheck_result.py",
    "src/rtfleet/report.py": "plugins/module_utils/report.py",
    "src/rtfleet/report_containers.py": "plugins/module_utils/report_containers.py",
    "src/rtfleet/report_doc.py": "plugins/module_utils/report_doc.py",
    "src/rtfleet/report_drift.py": "plugins/module_utils/report_drift.py",
    "src/rtfleet/report_files.py": "plugins/module_utils/report_files.py",
    "src/rtfleet/report_fleet.py": "plugins/module_utils/report_fleet.py",
    "src/rtfleet/report_plots.py": "plugins/module_utils/report_plots.py",
    "src/rtfleet/report_refused.py": "plugins/module_utils/report_refused.py",
    "src/rtfleet/report_stopped.py": "plugins/module_utils/report_stopped.py",
    "src/rtfleet/report_tables.py": "plugins/module_utils/report_tables.py",
    "src/rtfleet/sampler.py": "plugins/module_utils/sampler.py",
    "src/rtfleet/topology.py": "plugins/module_utils/topology.py",
}
HOMES = ("plugins/module_utils/", "shminfer")


def _tracked_links():
    listed = subprocess.run(
        ["git", "ls-files", "-s"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    return sorted(
        line.split("\t", 1)[1] for line in listed.splitlines() if line.startswith("120000")
    )


def test_every_link_is_listed_and_points_into_the_one_home_of_its_file():
    found = {
        link: os.path.relpath(os.path.realpath(REPO / link), REPO) for link in _tracked_links()
    }
    assert found == LINKS
    assert all(target.startswith(HOMES) for target in LINKS.values())
    assert not [t for t in LINKS.values() if any(t.startswith(h) for h in LINKS)]
    assert all((REPO / target).exists() for target in LINKS.values())


def _host_package_files():
    tasks = yaml.safe_load((REPO / "roles/rtfleet_host/tasks/runtime.yml").read_text())
    copy = next(t for t in tasks if t.get("name", "").startswith("Install rtfleet-host-tune"))
    return [i["src"] for i in copy["loop"] if i["src"].startswith("rtfleet_node/")]


def test_the_host_package_ships_every_file_it_imports(tmp_path):
    # Installed as the role installs it: the listed files only, links followed. A module of
    # the package that the list leaves out fails the import here, not on a host.
    files = REPO / "roles/rtfleet_host/files"
    shipped = _host_package_files()
    assert sorted(shipped) == sorted(
        "rtfleet_node/" + p.name for p in (files / "rtfleet_node").glob("*.py")
    )
    (tmp_path / "rtfleet_node").mkdir()
    for src in shipped:
        (tmp_path / src).write_bytes((files / src).read_bytes())
    for script in ("rtfleet-drift", "rtfleet-host-tune"):
        subprocess.run(
            [sys.executable, "-I", str(files / script), "--help"],
            env={"RTFLEET_LIB": str(tmp_path), "PATH": os.environ["PATH"]},
            capture_output=True,
            check=True,
        )


def test_the_built_collection_carries_what_users_run_and_no_development_parts(tmp_path):
    subprocess.run(
        [
            str(REPO / ".venv/bin/ansible-galaxy"),
            "collection",
            "build",
            "--output-path",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        capture_output=True,
    )
    (tarball,) = tmp_path.glob("rtfleet-fleet-*.tar.gz")
    with tarfile.open(tarball) as tar:
        names = set(tar.getnames())
    for dev in ("docs/dev", "tests/unit", "tests/drills", "molecule", "benchmarks", "lab/image"):
        assert not [n for n in names if n == dev or n.startswith(dev + "/")], dev
    # The operators' verify suite, ansible-test's ignores, the runtime and the files the
    # playbooks reach outside themselves (playbook_dir/..) are in it.
    needed = {
        "tests/infra/conftest.py",
        "tests/sanity/ignore-2.19.txt",
        "requirements.txt",
        "shminfer/src/shminfer/server.py",
        "roles/rtfleet_runtime/files/shminfer",
    }
    for path in sorted((REPO / "playbooks").rglob("*.yml")):
        needed |= set(re.findall(r"playbook_dir\W+/\.\./([\w./-]+)", path.read_text()))
    assert needed and needed <= names, sorted(needed - names)


# What rtfleet_host's read_plan leaves for the roles that include it: the facts it sets and
# the one include variable. rtfleet_host's defaults are in scope only inside the include, so
# any other rtfleet_host_* name in another role is undefined on a host that does not set it
# (a site run on a lab VM failed so: the runtime role's message named rtfleet_host_plan_file).
FROM_READ_PLAN = {"rtfleet_host_plan", "rtfleet_host_plan_found", "rtfleet_host_plan_required"}
# An inventory setting of the host that no role's defaults hold (the sampler role reads it
# with a default: the host's name).
INVENTORY_ONLY = {"rtfleet_host_class"}


def test_other_roles_use_only_what_read_plan_sets_of_the_host_role():
    used = {}
    for role in ("rtfleet_kubelet", "rtfleet_runtime", "rtfleet_postcheck", "rtfleet_sampler"):
        for path in sorted((REPO / "roles" / role).glob("t*/*")):  # tasks/, templates/
            for name in re.findall(r"\brtfleet_host_\w+", path.read_text()):
                used.setdefault(name, set()).add(str(path.relative_to(REPO)))
    assert {n: p for n, p in used.items() if n not in FROM_READ_PLAN | INVENTORY_ONLY} == {}
    defaults = (REPO / "roles/rtfleet_host/defaults").glob("*")
    assert not [f for f in defaults if INVENTORY_ONLY & set(f.read_text().split(":"))]
    assert "rtfleet_host_plan" in used


def test_the_plan_record_is_written_as_a_record_and_read_by_read_plan_only():
    """One writer (the host role's record task, each CPU set once) and one reader
    (rtfleet_host's read_plan) of /etc/rtfleet/plan.json in the roles and playbooks."""
    writers, readers = [], []
    for path in _files(".yml"):
        if path.parts[len(REPO.parts)] == "molecule":
            continue  # scenarios prepare and verify hosts their own way
        text = path.read_text()
        rel = str(path.relative_to(REPO))
        if re.search(r"dest:\s*/etc/rtfleet/plan\.json", text):
            writers.append(rel)
            assert "rtfleet.fleet.plan_to_record" in text, rel
        if re.search(r"rtfleet\.fleet\.plan_record\b|plan\.json.*from_json", text):
            readers.append(rel)
    assert writers == ["roles/rtfleet_host/tasks/record.yml"]
    assert readers == ["roles/rtfleet_host/tasks/read_plan.yml"]


def test_one_checker_of_a_host_against_its_plan():
    """kubelet's reserved CPUs and each unit's pinning are compared with the plan by the
    drift guard only: the post-check words its document, the testinfra suite runs it."""
    consistency = (REPO / "plugins/module_utils/postcheck_consistency.py").read_text()
    for compare in ("parse_cpulist", "systemd_cpus", 'reservedSystemCPUs")', 'CPUAffinity")'):
        assert compare not in consistency, compare
    role = (REPO / "roles/rtfleet_postcheck/tasks/consistency.yml").read_text()
    assert "rtfleet-drift, --check, --json" in role
    assert "systemctl" not in role and "slurp" not in role
    runtime = (REPO / "tests/infra/test_runtime.py").read_text()
    assert "drift_guard(host" in runtime and 'Cpus_allowed_list"]) for' not in runtime


# A value that only puts one variable (an attribute, an item, a plain default) into a string
# is not a program; anything else that is templated counts with all its lines.
_REFERENCE = re.compile(
    r"^[^{}]*\{\{\s*[\w.\[\]'\"]+(\s*\|\s*(default\([^()]*\)|list|int|bool|trim|string))*\s*\}\}"
    r"[^{}]*$"
)
_MODULES = ("ansible.builtin.command:", "ansible.builtin.shell:", "ansible.builtin.raw:")


def _jinja_lines(value):
    if isinstance(value, str):
        if "{{" not in value and "{%" not in value:
            return 0
        return 0 if _REFERENCE.match(value.strip()) else value.strip().count("\n") + 1
    if isinstance(value, dict):
        return sum(_jinja_lines(v) for v in value.values())
    if isinstance(value, list):
        return sum(_jinja_lines(v) for v in value)
    return 0


def _tasks(items):
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict):
            continue
        nested = [
            k for k in ("block", "rescue", "always", "tasks", "pre_tasks", "handlers") if k in item
        ]
        for key in nested:
            yield from _tasks(item[key])
        if not nested:
            yield item


def _task_files():
    return sorted([*REPO.glob("roles/*/tasks/*.yml"), *REPO.glob("playbooks/*.yml")])


def test_no_task_holds_a_program_in_jinja():
    """More than 10 lines of Jinja in one task is a program: it belongs in a tested filter
    or module (the sampler image's build became rtfleet.fleet.sampler_image)."""
    heavy = {}
    for path in _task_files():
        for task in _tasks(yaml.safe_load(path.read_text())):
            lines = _jinja_lines(task)
            if lines > 10:
                heavy["%s: %s" % (path.relative_to(REPO), task.get("name"))] = lines
    assert heavy == {}


def test_every_command_task_says_why_no_module_does_it():
    bare = []
    for path in _task_files():
        lines = path.read_text().splitlines()
        starts = [i for i, line in enumerate(lines) if re.match(r"^\s*- name:", line)]
        for n, start in enumerate(starts):
            body = lines[start : starts[n + 1] if n + 1 < len(starts) else len(lines)]
            if not any(line.strip().startswith(_MODULES) for line in body):
                continue
            while body and (not body[-1].strip() or body[-1].strip().startswith("#")):
                body.pop()  # the next task's comment
            above = start > 0 and lines[start - 1].strip().startswith("#")
            if not above and not any(line.strip().startswith("#") for line in body):
                bare.append("%s:%d" % (path.relative_to(REPO), start + 1))
    assert bare == []
