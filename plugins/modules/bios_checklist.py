#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: rtfleet contributors
# Apache-2.0
"""Ansible module: the BIOS / firmware checklist, verified from the OS."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: bios_checklist
short_description: Verify firmware settings (NPS, SMT, boost, C-states, P-state driver) from the OS
description:
  - Reads the host with rtfleet's topology reader and checks what the OS can see against
    O(wanted). Settings the OS cannot see are listed as manual items.
  - A mismatch fails the host unless the item is in O(waivers). Read-only; supports check mode.
version_added: "0.1.0"
options:
  root:
    description: Directory that holds C(sys/) and C(proc/) like a real root.
    type: path
    default: /
  wanted:
    description:
      - Wanted values; keys nps, smt, boost, max_idle_latency_us, frequency_driver, governor,
        memory_balance_max_ratio. A null value skips the item.
    type: dict
    default: {}
  waivers:
    description: Items whose mismatch (or manual status) is accepted for this host.
    type: list
    elements: str
    default: []
  fail_on_mismatch:
    description: Fail the host when an item mismatches.
    type: bool
    default: true
author:
  - rtfleet contributors (@rtfleet)
"""

EXAMPLES = r"""
- name: Verify the BIOS checklist
  rtfleet.fleet.bios_checklist:
    wanted:
      nps: 1
      smt: "off"
      frequency_driver: [amd-pstate-epp, acpi-cpufreq]
    waivers: [boost]
"""

RETURN = r"""
checklist:
  description: ok, failed and manual item names, and every item with wanted, observed, status, hint.
  returned: always
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.rtfleet.fleet.plugins.module_utils.checklist import (
    ChecklistError,
    evaluate,
)
from ansible_collections.rtfleet.fleet.plugins.module_utils.topology import (
    TopologyError,
    read_topology,
)


def build_module():
    return AnsibleModule(
        argument_spec=dict(
            root=dict(type="path", default="/"),
            wanted=dict(type="dict", default={}),
            waivers=dict(type="list", elements="str", default=[]),
            fail_on_mismatch=dict(type="bool", default=True),
        ),
        supports_check_mode=True,
    )


def run_module(module):
    try:
        result = evaluate(
            read_topology(module.params["root"]), module.params["wanted"], module.params["waivers"]
        )
    except (TopologyError, ChecklistError) as exc:
        module.fail_json(msg="BIOS checklist: %s" % exc)
    if result["failed"] and module.params["fail_on_mismatch"]:
        details = [
            "%s: wanted %s, observed %s (%s)" % (i["item"], i["wanted"], i["observed"], i["hint"])
            for i in result["items"]
            if i["status"] == "mismatch"
        ]
        module.fail_json(
            msg="BIOS checklist failed: "
            + "; ".join(details)
            + ". Fix the setting, or waive the item in inventory (rtfleet_host_bios_waivers).",
            checklist=result,
        )
    module.exit_json(changed=False, checklist=result)


def main():
    run_module(build_module())


if __name__ == "__main__":
    main()
