#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: rtfleet contributors
# Apache-2.0
"""Ansible module: the lab's sampler container image, one tar for podman import."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: sampler_image
short_description: Build the sampler container image the lab runs a sampler pod in, as a tar
description:
  - Finds in O(wheelhouse) the runtime bundle whose SHA-256 is O(bundle_sha256) (what the
    node's serving release was installed from) and writes O(dest)C(/sampler-NAME.tar.gz),
    which is O(base) (a Debian root file system) with the bundle's wheels but OpenVINO
    unpacked under C(/opt/sampler/site) and a C(/usr/local/bin/shminfer) launcher. The node
    makes it an image with C(podman import) and the returned RV(changes).
  - NAME comes from the inputs, so an existing tar is left alone (C(changed=false)).
  - "Runs on the controller (C(delegate_to: localhost)); the rtfleet_sampler role's
    C(container) entry point calls it."
version_added: "0.2.0"
options:
  base:
    description: The base root file system as a tar (the role's C(files/build-sampler-base.sh)).
    type: path
    required: true
  wheelhouse:
    description: The runtime role's controller cache (C(rtfleet_runtime_wheelhouse)).
    type: path
    required: true
  bundle_sha256:
    description: The bundle the node's release came from (its C(.complete)).
    type: str
    required: true
  dest:
    description: The directory the image tar goes to.
    type: path
    required: true
author:
  - rtfleet contributors (@rtfleet)
"""

EXAMPLES = r"""
- name: Build the sampler image on the controller
  rtfleet.fleet.sampler_image:
    base: ~/.cache/rtfleet/images/sampler-base-bookworm-0123456789ab.tar
    wheelhouse: ~/.cache/rtfleet/wheelhouse
    bundle_sha256: "{{ release_complete }}"
    dest: ~/.cache/rtfleet/images
  delegate_to: localhost
"""

RETURN = r"""
path:
  description: The image tar.
  returned: success
  type: str
tag:
  description: The image's name and tag for C(podman import) (C(localhost/rtfleet-sampler:NAME)).
  returned: success
  type: str
changes:
  description: The C(--change) instructions for C(podman import) (environment, user).
  returned: success
  type: list
  elements: str
bundle:
  description: The bundle the wheels came from.
  returned: success
  type: str
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.rtfleet.fleet.plugins.module_utils.sampler_image import (
    ImageError,
    build_image,
    find_bundle,
)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            base=dict(type="path", required=True),
            wheelhouse=dict(type="path", required=True),
            bundle_sha256=dict(type="str", required=True),
            dest=dict(type="path", required=True),
        ),
        supports_check_mode=False,
    )
    params = module.params
    try:
        bundle = find_bundle(params["wheelhouse"], params["bundle_sha256"].strip())
        result = build_image(params["base"], bundle, params["dest"])
    except (ImageError, OSError) as exc:
        module.fail_json(msg="rtfleet sampler image: %s" % exc)
    module.exit_json(bundle=str(bundle), **result)


if __name__ == "__main__":
    main()
