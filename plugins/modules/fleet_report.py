#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: rtfleet contributors
# Apache-2.0
"""Ansible module: the fleet report (HTML, Markdown, JSON, plots) from the per-host results."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: fleet_report
short_description: Write the rtfleet fleet report from the per-host post-check results
description:
  - Reads the per-host results the rtfleet_postcheck role wrote under O(results) (one
    C(<host>.json) each, plus the baselines, refusals, drift and container records) and
    writes C(report.html), C(report.md), C(report.json) and the latency plots to O(out),
    the same code as C(rtfleet report).
  - "Runs on the controller (C(delegate_to: localhost))."
  - Needs rich and, for the plots, matplotlib on the controller (the collection's
    C(requirements.txt)).
  - The fleet verdict is returned, not raised. A host that failed its gate already failed
    its own task, and the report says which and why.
version_added: "0.2.0"
options:
  results:
    description: Directory of the per-host results.
    type: path
    required: true
  out:
    description: Directory the report is written to (created if missing).
    type: path
    required: true
author:
  - rtfleet contributors (@rtfleet)
"""

EXAMPLES = r"""
- name: Build the fleet report
  rtfleet.fleet.fleet_report:
    results: "{{ playbook_dir }}/reports/results"
    out: "{{ playbook_dir }}/reports"
  delegate_to: localhost
"""

RETURN = r"""
passed:
  description: Whether every tuned host passed its gate.
  returned: success
  type: bool
verdict:
  description: The fleet verdict, C(passed) and C(reason).
  returned: success
  type: dict
files:
  description: Paths of the files written (html, markdown, json, plots).
  returned: success
  type: dict
hosts:
  description: One summary row per host with its gate failures.
  returned: success
  type: list
  elements: dict
table:
  description: The fleet table as text, for a person reading the play's output.
  returned: success
  type: list
  elements: str
"""

import io
import os
import traceback

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

from ansible_collections.rtfleet.fleet.plugins.module_utils.report_doc import (
    JINJA2_IMPORT_ERROR,
)
from ansible_collections.rtfleet.fleet.plugins.module_utils.report import build_report
from ansible_collections.rtfleet.fleet.plugins.module_utils.report_files import ReportError
from ansible_collections.rtfleet.fleet.plugins.module_utils.report_tables import (
    host_summary,
    render_fleet_table,
)

try:
    from rich.console import Console

    RICH_IMPORT_ERROR = None
except ImportError:
    Console = None
    RICH_IMPORT_ERROR = traceback.format_exc()


def main():
    module = AnsibleModule(
        argument_spec=dict(
            results=dict(type="path", required=True),
            out=dict(type="path", required=True),
        ),
        supports_check_mode=False,
    )
    if JINJA2_IMPORT_ERROR is not None:
        module.fail_json(msg=missing_required_lib("Jinja2"), exception=str(JINJA2_IMPORT_ERROR))
    if RICH_IMPORT_ERROR is not None:
        module.fail_json(msg=missing_required_lib("rich"), exception=RICH_IMPORT_ERROR)
    out = module.params["out"]
    try:
        fleet = build_report(module.params["results"], out)
    except ReportError as exc:
        module.fail_json(msg="rtfleet report: %s" % exc)
    files = {
        key: [os.path.join(out, p) for p in value]
        if isinstance(value, list)
        else os.path.join(out, value)
        for key, value in fleet["files"].items()
    }
    console = Console(record=True, width=150, file=io.StringIO(), highlight=False)
    render_fleet_table(fleet, console=console)
    table = console.export_text().splitlines()
    table.append("report: %s (also %s, %s)" % (files["html"], files["markdown"], files["json"]))
    module.exit_json(
        changed=True,
        passed=fleet["verdict"]["passed"],
        verdict=fleet["verdict"],
        files=files,
        hosts=[dict(host_summary(h), failures=h["gate"]["failures"]) for h in fleet["hosts"]],
        table=table,
    )


if __name__ == "__main__":
    main()
