#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: rtfleet contributors
# Apache-2.0
"""Ansible module: record the host as it was before rtfleet, check a host against it, and
put its live settings back (plugins/module_utils/original.py)."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: host_original
short_description: The host as it was before rtfleet first changed it
description:
  - V(recorded) writes the record once, before rtfleet's first change of the host, and
    afterwards only checks that the record there is this host's, unedited.
  - V(read) returns the record; V(compared) lists how the host differs from it;
    V(restored) writes back the sysctls, governors, hugepage pools and IRQ affinities it holds.
  - A record of another host (its C(/etc/machine-id)), an edited one, or one of an unknown
    schema fails the module in one line before anything changes.
version_added: "0.3.0"
options:
  state:
    description: What to do with the record.
    type: str
    choices: [recorded, read, compared, restored]
    default: recorded
  path:
    description: The record.
    type: path
    default: /var/lib/rtfleet/original/host.json
  sysctl_keys:
    description: The sysctls rtfleet sets, whose original values are recorded (V(recorded)).
    type: list
    elements: str
    default: []
  record:
    description: A record read before (V(compared) after the file was removed).
    type: dict
  rtfleet_packages:
    description: >-
      The packages rtfleet's roles install (V(compared)): those installed since the record
      are differences, with the kernel images and headers that came with them.
    type: list
    elements: str
    default: []
  root:
    description: Directory that holds C(proc/), C(sys/), C(etc/) and C(boot/) like a real root.
    type: path
    default: /
author:
  - rtfleet contributors (@rtfleet)
"""

EXAMPLES = r"""
- name: Record the host before its first change
  rtfleet.fleet.host_original:
    state: recorded
    sysctl_keys: [kernel.numa_balancing, kernel.sched_rt_runtime_us]

- name: Check a restored host
  rtfleet.fleet.host_original:
    state: compared
    record: "{{ original.record }}"
  register: restored
  failed_when: restored.differences | length > 0
"""

RETURN = r"""
record:
  description: The record (without its checksum).
  returned: always
  type: dict
differences:
  description: How the host differs from the record, one line each (V(compared)).
  returned: when state is compared
  type: list
  elements: str
remove_packages:
  description: Packages rtfleet installed since the record (V(compared)), to remove.
  returned: when state is compared
  type: list
  elements: str
added_sysctls:
  description: >-
    Sysctls rtfleet sets now but did not when the record was taken; their current values
    joined it.
  returned: when the record was extended
  type: list
  elements: str
restored:
  description: The settings written back (V(restored); in check mode, those that would be).
  returned: when state is restored
  type: list
  elements: str
skipped:
  description: Settings that could not be written back, with the reason.
  returned: when state is restored
  type: list
  elements: str
"""

import datetime
import json
import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.rtfleet.fleet.plugins.module_utils.boot import read_grub, read_running
from ansible_collections.rtfleet.fleet.plugins.module_utils.original import (
    UNITS,
    RecordError,
    compare,
    packages_to_remove,
    parse_record,
    read_host,
    restore_live,
    seal,
)


def _units(module):
    """{unit: {"enabled": ..., "active": ...}} as systemctl says ("not-found" when absent)."""
    out = {}
    for unit in UNITS:
        state = {}
        for verb in ("is-enabled", "is-active"):
            # systemctl is the only reader of a unit's enablement that knows every way a unit
            # can be enabled (symlinks, presets, aliases); the service_facts module lists
            # enablement but not for units that are not loaded.
            rc, out_, _err = module.run_command(["systemctl", verb, unit])
            word = out_.strip().splitlines()[0] if out_.strip() else ""
            state[verb[3:]] = word or ("not-found" if rc else "")
        out[unit] = state
    return out


def _boot(root):
    running = read_running(root)
    grub = read_grub(root)
    return {
        "release": running["release"],
        "cmdline": running["cmdline"],
        "grub_default": grub["saved_entry"],
    }


def _live(module, root, keys):
    return read_host(root, keys, _boot(root), _units(module) if root == "/" else {})


def _write(module, path, record):
    if module.check_mode:
        return
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(record, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(tmp, path)  # a power loss leaves no record or the whole one, never half of it
    dir_fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # and the rename itself reaches the disk before the first change
    finally:
        os.close(dir_fd)


def _load(module, path, root):
    machine_id = read_host(root, [], {}, {})["machine_id"]
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError:
        module.fail_json(
            msg="%s is missing: rtfleet never changed this host (or the record was removed), so"
            " there is nothing to restore it to; nothing was changed." % path
        )
    try:
        return parse_record(text, machine_id, path)
    except RecordError as exc:
        module.fail_json(msg=str(exc))


def main():
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(
                type="str", default="recorded", choices=["recorded", "read", "compared", "restored"]
            ),
            path=dict(type="path", default="/var/lib/rtfleet/original/host.json"),
            sysctl_keys=dict(type="list", elements="str", default=[], no_log=False),
            record=dict(type="dict"),
            rtfleet_packages=dict(type="list", elements="str", default=[]),
            root=dict(type="path", default="/"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    state, path, root = p["state"], p["path"], p["root"]

    if state == "recorded" and not os.path.exists(path):
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        record = seal(_live(module, root, p["sysctl_keys"]), now)
        _write(module, path, record)
        module.exit_json(changed=True, record={k: v for k, v in record.items() if k != "sha256"})

    record = p["record"] if state == "compared" and p["record"] else _load(module, path, root)
    new_keys = sorted(set(p["sysctl_keys"]) - set(record["sysctls"])) if state == "recorded" else []
    if new_keys:
        # A sysctl rtfleet did not set before still has the host's own value: it joins the
        # record, which is sealed again.
        record["sysctls"].update(read_host(root, new_keys, {}, {})["sysctls"])
        _write(
            module,
            path,
            seal(
                {k: v for k, v in record.items() if k not in ("schema", "recorded_at")},
                record["recorded_at"],
            ),
        )
        module.exit_json(changed=True, record=record, added_sysctls=new_keys)
    if state in ("recorded", "read"):
        module.exit_json(changed=False, record=record)
    if state == "compared":
        live = _live(module, root, list(record["sysctls"]))
        diffs = compare(record, live, p["rtfleet_packages"])
        module.exit_json(
            changed=False,
            record=record,
            differences=diffs,
            remove_packages=packages_to_remove(
                record["packages"], live["packages"], p["rtfleet_packages"]
            ),
        )
    restored, skipped = restore_live(root, record, check=module.check_mode)
    module.exit_json(changed=bool(restored), record=record, restored=restored, skipped=skipped)


if __name__ == "__main__":
    main()
