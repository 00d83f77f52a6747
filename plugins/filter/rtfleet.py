# -*- coding: utf-8 -*-
# Copyright: rtfleet contributors
# Apache-2.0
"""Ansible filters that expose rtfleet's planner and post-check gate to playbooks.

The filters run on the controller and call the collection's module_utils (``planner``,
``boot``, ``postcheck*``, ``sampler``, ``topology``), the same code as the ``rtfleet`` CLI, so
a role's kernel arguments, kubelet reserved set and unit pinning come from one computation;
likewise the post-check verdict comes from ``postcheck_gate``, as ``rtfleet report``'s. Use
them by their full names: ``{{ cpus | rtfleet.fleet.cpulist }}``.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

from ansible.errors import AnsibleFilterError

from ansible_collections.rtfleet.fleet.plugins.module_utils.boot import (
    BootConfigError,
    compose_kernel_args,
    hugepage_runtime_settings,
)
from ansible_collections.rtfleet.fleet.plugins.module_utils.bundle import (
    BundleError,
    space_checks,
)
from ansible_collections.rtfleet.fleet.plugins.module_utils.planner import (
    PlanError,
    plan_partition,
)
from ansible_collections.rtfleet.fleet.plugins.module_utils.plan_record import (
    PLAN_FILE,
    PlanRecordError,
    parse_plan,
    to_record,
)
from ansible_collections.rtfleet.fleet.plugins.module_utils.postcheck import (
    PostcheckError,
    check_settings,
)
from ansible_collections.rtfleet.fleet.plugins.module_utils.postcheck_consistency import (
    consistency_checks,
)
from ansible_collections.rtfleet.fleet.plugins.module_utils.postcheck_gate import (
    gate_host,
    hardware_gate,
)
from ansible_collections.rtfleet.fleet.plugins.module_utils.postcheck_parse import (
    parse_cyclictest,
)
from ansible_collections.rtfleet.fleet.plugins.module_utils.postcheck_result import (
    assemble_result,
    measure_targets,
)
from ansible_collections.rtfleet.fleet.plugins.module_utils.rollout import (
    SAFEST,
    RolloutError,
    batch_verdict,
    decide,
    decided,
)
from ansible_collections.rtfleet.fleet.plugins.module_utils.sampler import (
    SamplerError,
    check_manifest_text,
    podman_argv_text,
    sampler_classes,
)
from ansible_collections.rtfleet.fleet.plugins.module_utils.cpulist import (
    TopologyError,
    format_cpulist,
    format_cpumask,
    parse_cpulist,
)


def rtfleet_plan(topology, policy=None):
    """{{ rtfleet_topology | rtfleet.fleet.plan(policy) }} -> the partition plan dict."""
    if not isinstance(topology, dict):
        raise AnsibleFilterError("rtfleet_plan expects the rtfleet_topology fact (a dict)")
    try:
        return plan_partition(topology, dict(policy or {}))
    except PlanError as exc:
        raise AnsibleFilterError("rtfleet plan: %s" % exc) from None


def rtfleet_plan_record(text, path=PLAN_FILE):
    """{{ slurped.content | b64decode | rtfleet.fleet.plan_record(path) }} -> {"plan": the
    plan (the record's sets and every form derived from them), "error": ""}, its schema and
    CPU sets checked (module_utils/plan_record, as the
    drift guard checks it); a record no reader can use -> {"plan": {}, "error": one line}."""
    try:
        return {"plan": parse_plan(text), "error": ""}
    except PlanRecordError as exc:
        return {"plan": {}, "error": "cannot use %s: %s" % (path, exc)}


def rtfleet_plan_to_record(plan):
    """{{ rtfleet_host_plan | rtfleet.fleet.plan_to_record }} -> what /etc/rtfleet/plan.json
    stores of a plan: each CPU set once (module_utils/plan_record.to_record)."""
    if not isinstance(plan, dict) or "runtime_groups" not in plan:
        raise AnsibleFilterError("plan_to_record expects a plan (the rtfleet.fleet.plan filter's)")
    return to_record(plan)


def rtfleet_runtime_space(df_lines, bundle_bytes, release_bytes, min_free_mib):
    """{{ df.stdout_lines | rtfleet.fleet.runtime_space(bundle, release, min_free_mib) }}
    -> what must fit on which filesystem (module_utils/bundle.space_checks)."""
    try:
        return space_checks(list(df_lines), bundle_bytes, release_bytes, min_free_mib)
    except (BundleError, TypeError, ValueError) as exc:
        raise AnsibleFilterError("runtime_space: %s" % exc) from None


def rtfleet_cpulist(cpus):
    """[0, 1, 2, 8] -> "0-2,8"."""
    return format_cpulist(cpus)


def rtfleet_cpumask(cpus):
    """[0, 40] or "0,40" -> "00000100,00000001": the kernel's comma-grouped hex mask.

    The form every cpumask file takes (tracing_cpumask, /proc/irq/*/smp_affinity): one
    hex word longer than 8 digits is refused there, so "%x" breaks at CPU 32.
    """
    if isinstance(cpus, str):
        cpus = parse_cpulist(cpus)
    return format_cpumask(cpus)


def rtfleet_cpus(cpulist):
    """ "0-2,8" -> [0, 1, 2, 8]."""
    return parse_cpulist(str(cpulist))


def rtfleet_kernel_args(plan, topology, options=None):
    """{{ plan | rtfleet.fleet.kernel_args(rtfleet_topology, options) }} -> kernel args."""
    try:
        return compose_kernel_args(plan, topology, dict(options or {}))
    except BootConfigError as exc:
        raise AnsibleFilterError("rtfleet kernel command line: %s" % exc) from None


def rtfleet_hugepages(topology, size, per_node):
    """{{ rtfleet_topology | rtfleet.fleet.hugepages(size, per_node) }} -> what the tuner allocates.

    {"size_kb": 2048, "per_node": {"0": 64, ...}}, or {} when the size is reserved on the
    kernel command line (1G) or no pages are wanted.
    """
    try:
        return hugepage_runtime_settings(topology, size, per_node)
    except BootConfigError as exc:
        raise AnsibleFilterError("rtfleet hugepages: %s" % exc) from None


def rtfleet_cyclictest(doc):
    """{{ cyclictest_json | rtfleet.fleet.cyclictest }} -> {"summary": {...}, "cpus": [...]}.

    Takes the raw ``cyclictest --json`` document (dict or string).
    """
    try:
        return parse_cyclictest(doc)
    except PostcheckError as exc:
        raise AnsibleFilterError("rtfleet cyclictest: %s" % exc) from None


def rtfleet_postcheck_gate(result):
    """{{ result | rtfleet.fleet.postcheck_gate }} -> {"passed": bool, "failures": [...]}."""
    try:
        return gate_host(result)
    except PostcheckError as exc:
        raise AnsibleFilterError("rtfleet post-check gate: %s" % exc) from None


def rtfleet_postcheck_hardware_gate(result):
    """{{ partial | rtfleet.fleet.postcheck_hardware_gate }} -> {"passed", "measured", "failures"}.

    hwlatdetect alone, judged before the rest of the post-check runs.
    """
    try:
        parsed, failures = hardware_gate(result)
    except PostcheckError as exc:
        raise AnsibleFilterError("rtfleet post-check hwlatdetect: %s" % exc) from None
    return {"passed": not failures, "measured": parsed, "failures": failures}


def rtfleet_postcheck_settings_errors(settings):
    """{{ {'rtfleet_postcheck_duration': 60} | rtfleet.fleet.postcheck_settings_errors }}.

    -> [str], one line per bad setting."""
    return check_settings(dict(settings or {}))


def rtfleet_postcheck_targets(plan, online, kind, cpus=None, smoke=True):
    """{{ rtfleet_host_plan | rtfleet.fleet.postcheck_targets(online, kind, cpus, smoke) }}
    -> {"cpus", "housekeeping", "units", "clients", "clients_from"}
    (postcheck_result.measure_targets)."""
    try:
        return measure_targets(plan, online or [], kind, cpus or None, bool(smoke))
    except (KeyError, TypeError, IndexError, TopologyError) as exc:
        raise AnsibleFilterError("postcheck_targets: %s" % exc) from None


def rtfleet_postcheck_result(measured, thresholds):
    """{{ measured | rtfleet.fleet.postcheck_result(thresholds) }} -> the host's result
    (postcheck.py's schema, without its gate; postcheck_result.assemble_result)."""
    try:
        return assemble_result(measured, thresholds or {})
    except PostcheckError as exc:
        host = measured.get("host")
        raise AnsibleFilterError("postcheck result of %s: %s" % (host, exc)) from None
    except (KeyError, TypeError, ValueError) as exc:
        raise AnsibleFilterError("postcheck_result: bad input (%s)" % exc) from None


def rtfleet_postcheck_consistency(plan, observed):
    """{{ plan | rtfleet.fleet.postcheck_consistency(observed) }}: the checks' list.

    postcheck_consistency.consistency_checks: [{"check", "ok", "detail"}, ...].
    """
    try:
        return consistency_checks(plan, observed)
    except PostcheckError as exc:
        raise AnsibleFilterError("rtfleet post-check: %s" % exc) from None


def rtfleet_sampler_classes(records):
    """{{ host_records | rtfleet.fleet.sampler_classes }} -> [{"host_class", "spec", "settings",
    "node_names"} or {"host_class", "skipped", "node_names"}]: the sampler manifest's
    figures per host class (rtfleet.sampler)."""
    try:
        return sampler_classes(list(records))
    except SamplerError as exc:
        raise AnsibleFilterError("rtfleet samplers: %s" % exc) from None


def rtfleet_sampler_check(text, gid):
    """{{ manifest_text | rtfleet.fleet.sampler_check(gid) }} -> [str]: the rules it breaks."""
    return check_manifest_text(str(text), gid=int(gid))


def rtfleet_sampler_podman(text, cpus, mems, image=None, args=()):
    """{{ manifest_text | rtfleet.fleet.sampler_podman(cpus=[2, 3], mems=[0]) }} -> podman argv
    that runs one replica of the manifest's pod as a kubelet would place it."""
    try:
        argv = podman_argv_text(str(text), cpus=list(cpus), mems=list(mems), image=image)
        return argv + [str(a) for a in args]
    except SamplerError as exc:
        raise AnsibleFilterError("rtfleet samplers: %s" % exc) from None


_ROLLOUT_KEYS = ("rtfleet_serial", "rtfleet_max_fail_percentage")
# Where playbooks/rollout.yml keeps its decision: a fact of the controller's localhost.
_ROLLOUT_FACT = "__rtfleet_rollout"


def rtfleet_rollout_settings(hostvars, hosts):
    """{{ hostvars | rtfleet.fleet.rollout_settings(ansible_play_hosts_all) }} -> the rollout's
    one batch plan ({hosts, serial, max_fail_percentage}) from the targeted hosts' variables."""
    try:
        return decide(
            {
                host: {k: hostvars[host][k] for k in _ROLLOUT_KEYS if k in hostvars[host]}
                for host in hosts
            }
        )
    except RolloutError as exc:
        raise AnsibleFilterError(str(exc)) from None


def rtfleet_rollout_keyword(hostvars, key):
    """{{ hostvars | default(none) | rtfleet.fleet.rollout_keyword('serial') }}: the rolling
    play's serial or max_fail_percentage keyword from the decision; an error, never a default,
    when there is none."""
    if hostvars is None:
        # No play of this run has started: --syntax-check, --list-hosts and --list-tasks
        # template the keyword here. In a run, the deciding play targets the same hosts, so it
        # started unless no host matched, and then this play has no host either. The
        # smallest batch, should that reasoning ever fail.
        return SAFEST[key]
    decision = hostvars["localhost"].get(_ROLLOUT_FACT) if "localhost" in hostvars else None
    try:
        return decided(decision, key)
    except RolloutError as exc:
        raise AnsibleFilterError(str(exc)) from None


def rtfleet_rollout_batch_verdict(batch, survivors, max_fail_percentage):
    """{{ batch_hosts | rtfleet.fleet.rollout_batch_verdict(ansible_play_batch, 0) }} ->
    {lost, percent, stop, message}: whether the rollout goes on after a batch."""
    return batch_verdict(batch, survivors, max_fail_percentage)


class FilterModule(object):
    def filters(self):
        return {
            "plan": rtfleet_plan,
            "plan_record": rtfleet_plan_record,
            "plan_to_record": rtfleet_plan_to_record,
            "runtime_space": rtfleet_runtime_space,
            "cpulist": rtfleet_cpulist,
            "cpus": rtfleet_cpus,
            "cpumask": rtfleet_cpumask,
            "kernel_args": rtfleet_kernel_args,
            "hugepages": rtfleet_hugepages,
            "cyclictest": rtfleet_cyclictest,
            "postcheck_gate": rtfleet_postcheck_gate,
            "postcheck_hardware_gate": rtfleet_postcheck_hardware_gate,
            "postcheck_settings_errors": rtfleet_postcheck_settings_errors,
            "postcheck_consistency": rtfleet_postcheck_consistency,
            "postcheck_targets": rtfleet_postcheck_targets,
            "postcheck_result": rtfleet_postcheck_result,
            "rollout_settings": rtfleet_rollout_settings,
            "rollout_keyword": rtfleet_rollout_keyword,
            "rollout_batch_verdict": rtfleet_rollout_batch_verdict,
            "sampler_classes": rtfleet_sampler_classes,
            "sampler_check": rtfleet_sampler_check,
            "sampler_podman": rtfleet_sampler_podman,
        }
