"""The smoke test's "before" on an old host (roles/rtfleet_postcheck/tasks/baseline_smoke.yml),
run for real on this machine: the runtime role's `bundle` entry point builds the bundle, the
post-check unpacks it into a temporary directory, serves the OpenVINO model from there, runs
`shminfer smoke` against it, and leaves nothing behind: no directory, no process."""

from __future__ import annotations

import glob
import json
import os
import subprocess

from conftest import run_local_playbook

PLAYBOOK = """
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.include_role: {name: rtfleet.fleet.rtfleet_runtime, tasks_from: bundle}
    - ansible.builtin.set_fact:
        __rtfleet_postcheck_online: "{{ range(cpus | int) | list }}"
    - ansible.builtin.include_role:
        name: rtfleet.fleet.rtfleet_postcheck
        tasks_from: baseline_smoke
      vars:
        rtfleet_postcheck_baseline_bundle: "{{ rtfleet_runtime_bundle }}"
        rtfleet_postcheck_smoke_requests: 50
        rtfleet_postcheck_smoke_max_p99_ms: 100000
        rtfleet_postcheck_smoke_max_deschedule_p999_ms: 100000
        rtfleet_postcheck_smoke_max_cpu_ratio: 100
        rtfleet_postcheck_smoke_max_slow_infer: 1000
    - ansible.builtin.copy:
        content: >-
          {{ {'smoke': __rtfleet_postcheck_smoke, 'clients': __rtfleet_postcheck_clients}
             | to_json }}
        dest: "{{ out }}"
        mode: "0644"
"""


def _leftovers():
    tmp = os.environ.get("TMPDIR", "/tmp")
    return sorted(glob.glob(os.path.join(tmp, "rtfleet-smoke.*")))


def test_the_old_host_serves_the_model_from_a_temporary_directory_and_keeps_nothing(tmp_path):
    before = _leftovers()
    playbook = tmp_path / "baseline-smoke.yml"
    playbook.write_text(PLAYBOOK)
    out = tmp_path / "out.json"
    run = run_local_playbook(
        playbook, "-e", f"out={out}", "-e", f"cpus={len(os.sched_getaffinity(0))}"
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    result = json.loads(out.read_text())
    (smoke,) = result["smoke"]["results"]
    assert smoke["rc"] == 0, smoke["stderr"]
    figures = json.loads(smoke["stdout"])
    assert figures["server"] == "rtfleet-baseline" and figures["errors"] == 0
    assert figures["latency_ms_p99"] > 0 and "deschedule_ms_p999" in figures
    assert result["clients"] == [1 if len(os.sched_getaffinity(0)) > 1 else 0]
    # The client's own record of where it ran: the CPU the role's taskset gave it.
    assert figures["client_cpus"] == str(result["clients"][0])
    # Nothing stays: the directory is gone and so is the server.
    assert _leftovers() == before
    left = subprocess.run(
        ["pgrep", "-f", "shminfer.cli serve --name rtfleet-baseline"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert left.stdout.strip() == ""
