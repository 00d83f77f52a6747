#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: rtfleet contributors
# Apache-2.0
"""Ansible module: one reproducible tar of the wheels and the model a node installs."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: runtime_bundle
short_description: Write the reproducible tar the rtfleet_runtime role ships to a node
description:
  - Writes O(path) from O(members) with sorted names, a fixed mtime, root:root and fixed
    modes, so the same members give the same bytes and the role's copy to the node changes
    nothing when nothing changed. Each directory in the tar gets a C(SHA256SUMS) the node
    checks before it uses the files.
  - Leaves O(path) alone when it already holds those bytes (C(changed=false)).
  - "Runs on the controller (C(delegate_to: localhost))."
version_added: "0.2.0"
options:
  path:
    description: The tar file to write.
    type: path
    required: true
  members:
    description:
      - Members as C(DIR=PATH) (the member is C(DIR/<name of PATH>)) or C(DIR/NAME=PATH).
    type: list
    elements: str
    required: true
author:
  - rtfleet contributors (@rtfleet)
"""

EXAMPLES = r"""
- name: Bundle the shminfer wheel and the model
  rtfleet.fleet.runtime_bundle:
    path: /tmp/bundle-cp311-x86_64.tar
    members:
      - wheels=/tmp/wheelhouse/shminfer-0.2.0-py3-none-any.whl
      - models=/tmp/models/mlp.xml
  delegate_to: localhost
"""

RETURN = r"""
path:
  description: The tar file.
  returned: success
  type: str
sha256:
  description: SHA-256 of the tar.
  returned: success
  type: str
members:
  description: How many files the tar holds (without the SHA256SUMS).
  returned: success
  type: int
bytes:
  description: The tar's size in bytes.
  returned: success
  type: int
release_bytes:
  description: >-
    What the release takes on a node, over-estimated: the members unpacked, every wheel's
    files installed into a venv, a byte-compiled copy of each .py, each file in whole 4 KiB
    blocks. The runtime role checks the node has this much free before it ships anything.
  returned: success
  type: int
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.rtfleet.fleet.plugins.module_utils.bundle import BundleError, write_bundle


def main():
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type="path", required=True),
            members=dict(type="list", elements="str", required=True),
        ),
        supports_check_mode=False,
    )
    try:
        result = write_bundle(module.params["path"], module.params["members"])
    except (BundleError, OSError) as exc:
        module.fail_json(msg="rtfleet bundle: %s" % exc)
    module.exit_json(
        changed=result["changed"],
        path=result["path"],
        sha256=result["sha256"],
        members=result["members"],
        bytes=result["bytes"],
        release_bytes=result["release_bytes"],
    )


if __name__ == "__main__":
    main()
