# Copyright: rtfleet contributors
# Apache-2.0
"""The plan record (/etc/rtfleet/plan.json) as every reader takes it.

The host role writes it (planner.plan_partition's result); the kubelet, runtime and
post-check roles, the samplers playbook (through rtfleet_host's ``read_plan`` entry point and
the ``plan_record`` filter) and the drift guard on the host (drift.load_records) read it, each
through :func:`check_plan`: the record's ``schema`` must be one this collection reads, and the
fields the readers use must have their types. Anything else is one line naming what is wrong
and what to do, before a reader changes anything. Stdlib only (it ships to the host).
"""

from __future__ import annotations

import json
import re

PLAN_FILE = "/etc/rtfleet/plan.json"
SCHEMA_VERSION = 1  # what planner writes
READABLE_SCHEMAS = (1,)
CPU_SETS = ("online", "housekeeping", "runtime", "pod_pool", "isolated")
GROUP_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


class PlanRecordError(ValueError):
    """What is wrong with a plan record, in one line (without the file's name)."""


def _cpus(value, what):
    if not isinstance(value, list) or not all(
        isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in value
    ):
        raise PlanRecordError("%s is not a list of CPU numbers" % what)


def check_plan(plan):
    """``plan`` itself when it is a plan record this collection reads; PlanRecordError."""
    if not isinstance(plan, dict):
        raise PlanRecordError("the plan record is not a JSON object")
    schema = plan.get("schema")
    if isinstance(schema, bool) or schema not in READABLE_SCHEMAS:
        raise PlanRecordError(
            "plan schema %s is not one this collection reads (%s): re-run the host step "
            "(playbooks/host.yml) with this collection to record the plan again"
            % (json.dumps(schema), ", ".join(str(s) for s in READABLE_SCHEMAS))
        )
    missing = [k for k in (*CPU_SETS, "runtime_groups") if k not in plan]
    if missing:
        raise PlanRecordError("no %s in the plan record" % ", ".join(missing))
    for key in CPU_SETS:
        _cpus(plan[key], key)
    if not isinstance(plan["runtime_groups"], list):
        raise PlanRecordError("runtime_groups is not a list")
    for group in plan["runtime_groups"]:
        if not isinstance(group, dict) or not {"name", "cpus"} <= set(group):
            raise PlanRecordError("a runtime group without name or cpus")
        if not isinstance(group["name"], str) or not GROUP_NAME.match(group["name"]):
            raise PlanRecordError("runtime group name %r is not [A-Za-z0-9_-]+" % group["name"])
        _cpus(group["cpus"], "runtime group %s: cpus" % group["name"])
    return plan


def parse_plan(text):
    """The plan record from its JSON text, checked (:func:`check_plan`)."""
    try:
        plan = json.loads(text)
    except ValueError as exc:
        raise PlanRecordError("not JSON (%s)" % exc) from None
    return check_plan(plan)
