# -*- coding: utf-8 -*-
# Copyright: rtfleet contributors
# Apache-2.0
"""Ansible filters that expose rtfleet's planner and post-check gate to playbooks.

The filters run on the controller and call the same ``rtfleet.planner`` as the CLI, so a
role's kernel arguments, kubelet reserved set and unit pinning come from one computation;
likewise the post-check verdict comes from ``rtfleet.postcheck``, as ``rtfleet report``'s.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

from ansible.errors import AnsibleFilterError

try:
    from rtfleet.boot import BootConfigError, compose_kernel_args, hugepage_runtime_settings
    from rtfleet.planner import PlanError, plan_partition
    from rtfleet.postcheck import PostcheckError, gate_host, parse_cyclictest
    from rtfleet.topology import format_cpulist, parse_cpulist

    _IMPORT_ERROR = None
except ImportError as exc:  # pragma: no cover - depends on the controller's environment
    _IMPORT_ERROR = exc


def _require():
    if _IMPORT_ERROR is not None:
        raise AnsibleFilterError(
            "the rtfleet Python package is not importable by this ansible-playbook (%s): run "
            "`make setup` and use .venv/bin/ansible-playbook" % _IMPORT_ERROR
        )


def rtfleet_plan(topology, policy=None):
    """{{ rtfleet_topology | rtfleet_plan(policy) }} -> the partition plan dict."""
    _require()
    if not isinstance(topology, dict):
        raise AnsibleFilterError("rtfleet_plan expects the rtfleet_topology fact (a dict)")
    try:
        return plan_partition(topology, dict(policy or {}))
    except PlanError as exc:
        raise AnsibleFilterError("rtfleet plan: %s" % exc) from None


def rtfleet_cpulist(cpus):
    """[0, 1, 2, 8] -> "0-2,8"."""
    _require()
    return format_cpulist(cpus)


def rtfleet_cpus(cpulist):
    """ "0-2,8" -> [0, 1, 2, 8]."""
    _require()
    return parse_cpulist(str(cpulist))


def rtfleet_kernel_args(plan, topology, options=None):
    """{{ plan | rtfleet_kernel_args(rtfleet_topology, options) }} -> the host's kernel args."""
    _require()
    try:
        return compose_kernel_args(plan, topology, dict(options or {}))
    except BootConfigError as exc:
        raise AnsibleFilterError("rtfleet kernel command line: %s" % exc) from None


def rtfleet_hugepages(topology, size, per_node):
    """{{ rtfleet_topology | rtfleet_hugepages(size, per_node) }} -> what the tuner allocates.

    {"size_kb": 2048, "per_node": {"0": 64, ...}}, or {} when the size is reserved on the
    kernel command line (1G) or no pages are wanted.
    """
    _require()
    try:
        return hugepage_runtime_settings(topology, size, per_node)
    except BootConfigError as exc:
        raise AnsibleFilterError("rtfleet hugepages: %s" % exc) from None


def rtfleet_cyclictest(doc):
    """{{ cyclictest_json | rtfleet_cyclictest }} -> {"summary": {...}, "cpus": [...]}.

    Takes the raw ``cyclictest --json`` document (dict or string).
    """
    _require()
    try:
        return parse_cyclictest(doc)
    except PostcheckError as exc:
        raise AnsibleFilterError("rtfleet cyclictest: %s" % exc) from None


def rtfleet_postcheck_gate(result):
    """{{ postcheck_result | rtfleet_postcheck_gate }} -> {"passed": bool, "failures": [...]}."""
    _require()
    try:
        return gate_host(result)
    except PostcheckError as exc:
        raise AnsibleFilterError("rtfleet post-check gate: %s" % exc) from None


class FilterModule(object):
    def filters(self):
        return {
            "rtfleet_plan": rtfleet_plan,
            "rtfleet_cpulist": rtfleet_cpulist,
            "rtfleet_cpus": rtfleet_cpus,
            "rtfleet_kernel_args": rtfleet_kernel_args,
            "rtfleet_hugepages": rtfleet_hugepages,
            "rtfleet_cyclictest": rtfleet_cyclictest,
            "rtfleet_postcheck_gate": rtfleet_postcheck_gate,
        }
