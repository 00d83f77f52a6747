#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: rtfleet contributors
# Apache-2.0
"""Ansible module: validate and render kubelet's CPU/Topology/Memory Manager configuration."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: kubelet_config
short_description: Validate and render kubelet's CPU, Topology and Memory Manager configuration
description:
  - Renders the KubeletConfiguration keys (static CPU Manager with the plan's reserved CPUs,
    policy options, Topology Manager, Static Memory Manager with reservedMemory per NUMA
    node, reservations, feature gates, extra keys) from an rtfleet plan and topology.
  - Validates the effective configuration (kubelet's main config merged with the rendered
    keys) with the rules kubelet itself enforces, and fails listing every problem with
    what to change.
  - Reads the file it would write and kubelet's checkpoint files, and decides whether the
    file changes and which checkpoints must be reset. Writes nothing; supports check mode.
version_added: "0.1.0"
options:
  plan:
    description: The partition plan (the rtfleet_plan filter's result).
    type: dict
    required: true
  topology:
    description: The rtfleet_topology fact of this host.
    type: dict
    required: true
  settings:
    description:
      - kubelet_version, config_mode, cpu_manager_policy_options, cpu_manager_reconcile_period,
        reserved_system_cpus, topology_manager_policy, topology_manager_scope,
        topology_manager_policy_options, memory_manager_policy, reserved_memory, kube_reserved,
        system_reserved, eviction_hard, feature_gates, allow_alpha_options, extra
        (see roles/rtfleet_kubelet/README.md).
    type: dict
    default: {}
  base_config:
    description: kubelet's main configuration file as parsed (empty when there is none).
    type: dict
    default: {}
  dropin_path:
    description: The drop-in file written when the kubelet version reads --config-dir.
    type: path
    default: /etc/kubernetes/kubelet.conf.d/90-rtfleet.conf
  main_config_path:
    description: kubelet's main configuration file, rewritten merged for older kubelets.
    type: path
    default: /var/lib/kubelet/config.yaml
  state_dir:
    description: kubelet's root directory holding cpu_manager_state and memory_manager_state.
    type: path
    default: /var/lib/kubelet
  proc_root:
    description: Where a running kubelet's command line is looked for (its --config-dir).
    type: path
    default: /proc
  header:
    description: Comment lines at the top of the file (the managed marker).
    type: str
    default: Managed by rtfleet (role rtfleet_kubelet). Local changes are overwritten.
author:
  - rtfleet contributors (@rtfleet)
"""

EXAMPLES = r"""
- name: Read the plan the host role recorded
  ansible.builtin.slurp:
    src: /etc/rtfleet/plan.json
  register: plan_record

- name: Validate and render the kubelet configuration
  rtfleet.fleet.kubelet_config:
    plan: "{{ plan_record.content | b64decode | from_json }}"
    topology: "{{ rtfleet_topology }}"
    settings:
      kubelet_version: "1.31"
      cpu_manager_policy_options:
        full-pcpus-only: "true"
  register: kubelet
"""

RETURN = r"""
config_path:
  description: The file to write (the drop-in, or the main config for older kubelets).
  returned: always
  type: str
dropin:
  description: Whether config_path is a drop-in in kubelet's --config-dir.
  returned: always
  type: bool
content:
  description: The file content (managed header, then the configuration as JSON).
  returned: always
  type: str
config:
  description: The configuration written to config_path.
  returned: always
  type: dict
effective:
  description: kubelet's effective configuration after the change (main merged with drop-in).
  returned: always
  type: dict
config_changed:
  description: config_path is missing or differs from content.
  returned: always
  type: bool
config_exists:
  description: config_path exists now (it is backed up before it is replaced).
  returned: always
  type: bool
checkpoints:
  description: Per checkpoint (cpu_manager_state, memory_manager_state) exists, reset, reasons.
  returned: always
  type: dict
state_reset_needed:
  description: Some existing checkpoint must be backed up and removed before kubelet starts.
  returned: always
  type: bool
"""

import os

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.rtfleet.fleet.plugins.module_utils.kubelet import (
    build,
    config_target,
    dump,
    normalize_settings,
)
from ansible_collections.rtfleet.fleet.plugins.module_utils.kubelet_state import dropin_warning
from ansible_collections.rtfleet.fleet.plugins.module_utils.kubelet_values import (
    KubeletConfigError,
    parse_version,
)


def build_module():
    return AnsibleModule(
        argument_spec=dict(
            plan=dict(type="dict", required=True),
            topology=dict(type="dict", required=True),
            settings=dict(type="dict", default={}),
            base_config=dict(type="dict", default={}),
            dropin_path=dict(type="path", default="/etc/kubernetes/kubelet.conf.d/90-rtfleet.conf"),
            main_config_path=dict(type="path", default="/var/lib/kubelet/config.yaml"),
            state_dir=dict(type="path", default="/var/lib/kubelet"),
            proc_root=dict(type="path", default="/proc"),
            header=dict(
                type="str",
                default="Managed by rtfleet (role rtfleet_kubelet). Local changes are overwritten.",
            ),
        ),
        supports_check_mode=True,
    )


def _read(path):
    try:
        with open(path, "r") as handle:
            return handle.read()
    except (IOError, OSError):
        return None


def _running_kubelet_argv(proc_root):
    """The command line of a running kubelet process, or None."""
    try:
        pids = [name for name in os.listdir(proc_root) if name.isdigit()]
    except OSError:
        return None
    for pid in pids:
        comm = _read(os.path.join(proc_root, pid, "comm"))
        if comm is not None and comm.strip() == "kubelet":
            cmdline = _read(os.path.join(proc_root, pid, "cmdline")) or ""
            return [arg for arg in cmdline.split("\0") if arg]
    return None


def run_module(module):
    params = module.params
    settings = params["settings"]
    # Which file is written depends on the version; read both candidates once.
    texts = {path: _read(path) for path in (params["dropin_path"], params["main_config_path"])}
    state_dir = params["state_dir"]
    cpu_state = _read(os.path.join(state_dir, "cpu_manager_state"))
    memory_state = _read(os.path.join(state_dir, "memory_manager_state"))
    try:
        normalized = normalize_settings(settings)
        use_dropin = config_target(
            parse_version(normalized["kubelet_version"]), normalized["config_mode"]
        )[0]
        dest = params["dropin_path"] if use_dropin else params["main_config_path"]
        result = build(
            params["plan"],
            params["topology"],
            settings,
            base_config=params["base_config"],
            previous_text=texts[dest] if use_dropin else None,
            cpu_state=cpu_state,
            memory_state=memory_state,
        )
    except KubeletConfigError as exc:
        module.fail_json(msg=str(exc))
    argv = _running_kubelet_argv(params["proc_root"]) if result["dropin"] else None
    if argv is not None:
        warning = dropin_warning(argv, os.path.dirname(dest))
        if warning:
            result["warnings"].append(warning)
    for warning in result["warnings"]:
        module.warn(warning)
    content = dump(result["config"], params["header"])
    state_reset_needed = any(s["reset"] for s in result["state"].values())
    module.exit_json(
        changed=False,
        config_path=dest,
        dropin=result["dropin"],
        version=result["version"],
        content=content,
        config=result["config"],
        effective=result["effective"],
        previous=result["previous"],
        config_changed=texts[dest] != content,
        config_exists=texts[dest] is not None,
        checkpoints=result["state"],
        state_reset_needed=state_reset_needed,
        warnings_list=result["warnings"],
    )


def main():
    run_module(build_module())


if __name__ == "__main__":
    main()
