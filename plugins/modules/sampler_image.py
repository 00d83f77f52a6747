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
  - Writes O(dest)C(/sampler-NAME.tar.gz), which is O(base) (a Debian root file system) with
    the wheels in O(wheels) but OpenVINO unpacked under C(/opt/sampler/site) and a
    C(/usr/local/bin/shminfer) launcher. The node makes it an image with C(podman import)
    and the returned RV(changes).
  - NAME comes from the inputs (the base's name and size, each wheel's name and SHA-256), so
    an existing tar is left alone (C(changed=false)).
  - "Runs on the controller (C(delegate_to: localhost)); the rtfleet_sampler role calls it
    with the wheels it fetched from the node's serving release."
version_added: "0.2.0"
options:
  base:
    description: The base root file system as a tar (the role's C(files/build-sampler-base.sh)).
    type: path
    required: true
  wheels:
    description: A directory of the wheels to put into the image (C(openvino*) left out).
    type: path
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
    wheels: ~/.cache/rtfleet/images/wheels/0123456789ab
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
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.rtfleet.fleet.plugins.module_utils.sampler_image import (
    ImageError,
    build_image,
)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            base=dict(type="path", required=True),
            wheels=dict(type="path", required=True),
            dest=dict(type="path", required=True),
        ),
        supports_check_mode=False,
    )
    params = module.params
    try:
        result = build_image(params["base"], params["wheels"], params["dest"])
    except (ImageError, OSError) as exc:
        module.fail_json(msg="rtfleet sampler image: %s" % exc)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
