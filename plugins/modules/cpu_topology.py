#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: rtfleet contributors
# Apache-2.0
"""Ansible fact module: the host's CPU topology, read by rtfleet's one topology parser."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: cpu_topology
short_description: Gather CPU, L3 (CCX), NUMA, SMT, kernel and hypervisor facts
description:
  - Reads C(/sys) and C(/proc) under O(root) with the same parser as C(rtfleet topology)
    and returns the result as the C(rtfleet_topology) fact.
  - Includes a topology-deception verdict for virtual machines that present every vCPU as
    its own socket and hide NUMA (the VMware 88 sockets x 1 core case), with its evidence.
  - Read-only; supports check mode.
version_added: "0.1.0"
options:
  root:
    description: Directory that holds C(sys/) and C(proc/) like a real root.
    type: path
    default: /
author:
  - rtfleet contributors (@rtfleet)
"""

EXAMPLES = r"""
- name: Gather CPU topology facts
  rtfleet.fleet.cpu_topology:

- name: Show the L3 groups
  ansible.builtin.debug:
    msg: "{{ rtfleet_topology.l3_groups }}"
"""

RETURN = r"""
ansible_facts:
  description: Facts to add to the host's facts.
  returned: always
  type: dict
  contains:
    rtfleet_topology:
      description: >-
        Topology as returned by C(rtfleet topology --format json): cpus, packages, dies,
        clusters, numa_nodes, l3_groups, cores, smt, kernel, isolation, virtualization.
      returned: always
      type: dict
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.rtfleet.fleet.plugins.module_utils.topology import (
    TopologyError,
    read_topology,
)


def build_module():
    return AnsibleModule(
        argument_spec=dict(root=dict(type="path", default="/")),
        supports_check_mode=True,
    )


def run_module(module):
    try:
        topology = read_topology(module.params["root"])
    except TopologyError as exc:
        module.fail_json(msg="cannot read the CPU topology: %s" % exc, path=exc.path)
    module.exit_json(changed=False, ansible_facts=dict(rtfleet_topology=topology))


def main():
    run_module(build_module())


if __name__ == "__main__":
    main()
