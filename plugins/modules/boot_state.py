#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: rtfleet contributors
# Apache-2.0
"""Ansible module: the running kernel and GRUB's boot entries, checked against a wanted boot."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: boot_state
short_description: Read the running kernel and GRUB's entries; verify a wanted boot
description:
  - Reads C(/proc/cmdline), the kernel release, C(/sys/kernel/realtime),
    C(/sys/devices/system/cpu/isolated) and C(nohz_full), the kernels installed in C(/boot),
    and GRUB's menu (C(grub.cfg)) and environment block (C(grubenv)).
  - With O(wanted), compares the running host with it and returns the mismatches; the
    module itself never fails on a mismatch (the caller decides), and never changes anything.
version_added: "0.1.0"
options:
  root:
    description: Directory that holds C(proc/), C(sys/) and C(boot/) like a real root.
    type: path
    default: /
  grub_cfg:
    description: GRUB's generated menu, relative to O(root).
    type: str
    default: boot/grub/grub.cfg
  grubenv:
    description: GRUB's environment block, relative to O(root).
    type: str
    default: boot/grub/grubenv
  flavour:
    description: Pick the newest installed kernel of this flavour as RV(target_release).
    type: str
    choices: [rt, tuned, stock]
  wanted:
    description: >-
      The boot to verify: C(release) (kernel release), C(flavour) and C(args) (every
      argument must be in C(/proc/cmdline); C(isolated) and C(nohz_full) must match them).
    type: dict
author:
  - rtfleet contributors (@rtfleet)
"""

EXAMPLES = r"""
- name: Verify the trial boot
  rtfleet.fleet.boot_state:
    wanted:
      release: 6.1.0-57-rt-amd64
      flavour: rt
      args: ["isolcpus=managed_irq,1-3", "nohz_full=1-3"]
  register: boot
  failed_when: boot.mismatches | length > 0
"""

RETURN = r"""
running:
  description: release, cmdline, args, realtime, isolated, nohz_full of the running kernel.
  returned: always
  type: dict
installed:
  description: Kernel releases with an image in /boot, newest first.
  returned: always
  type: list
  elements: str
target_release:
  description: Newest installed kernel of O(flavour) (null when none is installed).
  returned: when O(flavour) is set
  type: str
grub:
  description: >-
    entries (title, id, title_path, id_path, top_index, release, args), saved_entry,
    next_entry, default (the entry GRUB boots when no one-shot entry is pending),
    running_entry (the distribution's entry for the running kernel), trial_entry (id
    rtfleet-trial, if present) and target_entry (for RV(target_release)).
  returned: always
  type: dict
mismatches:
  description: What differs from O(wanted); empty when the host runs the wanted boot.
  returned: always
  type: list
  elements: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.rtfleet.fleet.plugins.module_utils.boot import (
    installed_kernels,
    kernel_entry,
    pick_kernel,
    read_grub,
    read_running,
    verify,
)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            root=dict(type="path", default="/"),
            grub_cfg=dict(type="str", default="boot/grub/grub.cfg"),
            grubenv=dict(type="str", default="boot/grub/grubenv"),
            flavour=dict(type="str", choices=["rt", "tuned", "stock"]),
            wanted=dict(type="dict"),
        ),
        supports_check_mode=True,
    )
    root = module.params["root"]
    running = read_running(root)
    installed = installed_kernels(root)
    grub = read_grub(root, module.params["grub_cfg"], module.params["grubenv"])
    grub["running_entry"] = kernel_entry(grub["entries"], running["release"])
    grub["trial_entry"] = next((e for e in grub["entries"] if e["id"] == "rtfleet-trial"), None)
    result = dict(
        changed=False,
        running=running,
        installed=installed,
        grub=grub,
        mismatches=verify(module.params["wanted"], running) if module.params["wanted"] else [],
    )
    if module.params["flavour"]:
        target = pick_kernel(installed, module.params["flavour"])
        result["target_release"] = target
        grub["target_entry"] = kernel_entry(grub["entries"], target) if target else None
    module.exit_json(**result)


if __name__ == "__main__":
    main()
