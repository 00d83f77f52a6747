"""What kubelet keeps on a host: its checkpoints, and the command line it runs with.

The CPU and Memory Manager write a checkpoint (``cpu_manager_state``,
``memory_manager_state``) under the policy and reservation they started with, and refuse to
start when the configuration no longer matches it: :func:`state_reset` decides which
checkpoints must go before kubelet restarts. :func:`dropin_warning` says when a running
kubelet would not read rtfleet's drop-in. Stdlib-only, Python 3.9-compatible.
"""

from __future__ import annotations

import json

from .kubelet_values import parse_cpuset, parse_quantity


# ------------------------------------------------------------------ state checkpoints


def _cpu_identity(config):
    try:
        reserved = parse_cpuset(config.get("reservedSystemCPUs", ""))
    except ValueError:
        reserved = str(config.get("reservedSystemCPUs"))
    return {
        "policy": config.get("cpuManagerPolicy", "none"),
        "reservedSystemCPUs": reserved,
        "options": dict(config.get("cpuManagerPolicyOptions") or {}),
    }


def _memory_identity(config):
    reserved = {}
    for entry in config.get("reservedMemory") or []:
        if not isinstance(entry, dict):
            continue
        for name, value in (entry.get("limits") or {}).items():
            try:
                amount = str(parse_quantity(value))
            except ValueError:
                amount = str(value)
            reserved["%s/%s" % (entry.get("numaNode"), name)] = amount
    return {"policy": config.get("memoryManagerPolicy", "None"), "reservedMemory": reserved}


def state_reset(previous, new, cpu_state=None, memory_state=None):
    """Which kubelet checkpoints must go before kubelet starts with ``new``.

    ``previous`` is the effective configuration kubelet last ran with (None when unknown);
    ``cpu_state`` / ``memory_state`` the checkpoint contents (None when absent). A checkpoint
    that does not exist never needs a reset.
    """
    result = {}
    for name, identity, state, field_names in (
        (
            "cpu_manager_state",
            _cpu_identity,
            cpu_state,
            {
                "policy": "cpuManagerPolicy",
                "reservedSystemCPUs": "reservedSystemCPUs",
                "options": "cpuManagerPolicyOptions",
            },
        ),
        (
            "memory_manager_state",
            _memory_identity,
            memory_state,
            {"policy": "memoryManagerPolicy", "reservedMemory": "reservedMemory"},
        ),
    ):
        reasons = []
        new_id = identity(new)
        if previous is None:
            reasons.append("the previous configuration is unknown")
        else:
            old_id = identity(previous)
            for key, label in field_names.items():
                if old_id[key] != new_id[key]:
                    reasons.append("%s changed" % label)
        if state is not None:
            try:
                recorded = json.loads(state).get("policyName")
            except (ValueError, AttributeError):
                recorded = None
                reasons.append("the checkpoint is unreadable")
            if recorded is not None and recorded != new_id["policy"]:
                reasons.append(
                    "the checkpoint records policy %r, the new configuration %r"
                    % (recorded, new_id["policy"])
                )
        result[name] = {
            "exists": state is not None,
            "reset": state is not None and bool(reasons),
            "reasons": reasons if state is not None else [],
        }
    return result


# ------------------------------------------------------------------ running kubelet


def config_dir_of(argv):
    """The --config-dir a kubelet command line passes ("" when it passes none)."""
    for index, arg in enumerate(argv):
        if arg.startswith("--config-dir="):
            return arg.split("=", 1)[1]
        if arg == "--config-dir" and index + 1 < len(argv):
            return argv[index + 1]
    return ""


def dropin_warning(argv, config_dir):
    """A warning when a running kubelet would not read rtfleet's drop-in, else None."""
    seen = config_dir_of(argv).rstrip("/")
    if seen == config_dir.rstrip("/"):
        return None
    return (
        "the running kubelet %s, so it will not read rtfleet's drop-in in %s: add "
        "--config-dir=%s to its command line (kubeadm: KUBELET_EXTRA_ARGS)"
        % (
            "reads --config-dir=%s" % seen if seen else "has no --config-dir",
            config_dir,
            config_dir,
        )
    )
