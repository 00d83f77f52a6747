# -*- coding: utf-8 -*-
# Copyright: rtfleet contributors
# Apache-2.0
"""The rollout's batch settings: rtfleet_serial and rtfleet_max_fail_percentage, read from
the targeted hosts' inventory variables and checked once.

``serial`` and ``max_fail_percentage`` are play keywords. Ansible templates them before the
play's hosts are known to it and without any host's group_vars; ``hostvars`` exists at that
point only once an earlier play of the run has started (ansible-core creates it in its task
queue manager). So playbooks/rollout.yml decides the settings in a first play that targets
exactly the hosts the rolling play will (``--limit`` included), stores them on the
controller, and the rolling play's keywords read that decision with :func:`decided`, which
refuses to guess: a missing decision is an error, never the default canary.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import re

DEFAULT_SERIAL = [1, "10%", "100%"]
DEFAULT_MAX_FAIL_PERCENTAGE = 0
# One host at a time, stop at the first failure.
SAFEST = {"serial": 1, "max_fail_percentage": 0}
_BATCH = re.compile(r"^([1-9][0-9]*|([1-9][0-9]?|100)%)$")
_PERCENT = re.compile(r"^([0-9]|[1-9][0-9]|100)$")
_USAGE = (
    "rtfleet_serial must be one value for all targeted hosts: a host count (1), a percentage"
    ' ("25%") or a list of them ([1, "10%", "100%"]), and rtfleet_max_fail_percentage an'
    " integer 0-100 (0 stops at the first failed host)"
)


class RolloutError(ValueError):
    """Settings that cannot be rolled out; the message is one line a person can act on."""


def _batch(value):
    text = str(value).strip()
    if isinstance(value, bool) or not _BATCH.match(text):
        raise RolloutError("%s; got rtfleet_serial entry %r." % (_USAGE, value))
    return int(text) if text.isdigit() else text


def normalise_serial(value):
    """1, "2", "25%" or a list of them -> what the serial keyword takes (ints stay ints)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise RolloutError("%s; got an empty list." % _USAGE)
        return [_batch(v) for v in value]
    return _batch(value)


def normalise_max_fail(value):
    text = str(value).strip()
    if isinstance(value, bool) or not _PERCENT.match(text):
        raise RolloutError("%s; got rtfleet_max_fail_percentage %r." % (_USAGE, value))
    return int(text)


def decide(settings_by_host):
    """{host: {"rtfleet_serial": ..., "rtfleet_max_fail_percentage": ...}} (either key may be
    absent) -> {"hosts": [...], "serial": ..., "max_fail_percentage": int}.

    Every host must name the same settings (or leave them to the default): a rollout has one
    batch plan, and which host's variables would win is not something to guess."""
    if not settings_by_host:
        raise RolloutError(
            "no targeted host: nothing to roll out (check --limit and rtfleet_target)."
        )
    seen = {"rtfleet_serial": {}, "rtfleet_max_fail_percentage": {}}
    for host, own in settings_by_host.items():
        serial = normalise_serial(own.get("rtfleet_serial", DEFAULT_SERIAL))
        fail = normalise_max_fail(
            own.get("rtfleet_max_fail_percentage", DEFAULT_MAX_FAIL_PERCENTAGE)
        )
        for name, value in (("rtfleet_serial", serial), ("rtfleet_max_fail_percentage", fail)):
            seen[name].setdefault(repr(value), (value, []))[1].append(host)
    for name, values in seen.items():
        if len(values) > 1:
            groups = "; ".join(
                "%s on %s" % (value, _hosts(hosts)) for value, hosts in values.values()
            )
            raise RolloutError(
                "%s; the targeted hosts disagree on %s: %s." % (_USAGE, name, groups)
            )
    serial = next(iter(seen["rtfleet_serial"].values()))[0]
    fail = next(iter(seen["rtfleet_max_fail_percentage"].values()))[0]
    return {"hosts": sorted(settings_by_host), "serial": serial, "max_fail_percentage": fail}


def _hosts(names, most=4):
    names = sorted(names)
    more = len(names) - most
    return ", ".join(names[:most]) + (" and %d more" % more if more > 0 else "")


def decided(decision, key):
    """The rolling play's keyword from the first play's decision; never a default."""
    if not isinstance(decision, dict) or key not in decision:
        raise RolloutError(
            "rtfleet: the rollout batches were not decided, so rtfleet_serial and"
            " rtfleet_max_fail_percentage cannot be read: run playbooks/rollout.yml whole"
            " (its first play reads them from the targeted hosts), not its rolling play alone."
        )
    return decision[key]


def describe(decision):
    """One line for the operator: how many hosts, in which batches."""
    return "%d host(s), batches of %s, stopping when more than %d %% of a batch fails." % (
        len(decision["hosts"]),
        decision["serial"],
        decision["max_fail_percentage"],
    )


def batch_verdict(batch, survivors, max_fail_percentage):
    """After a batch: the hosts it started with and those still in play -> whether the
    rollout goes on. A host that failed (it stays cordoned) and one that could not be reached
    count alike; Ansible's own max_fail_percentage counts only the first kind, and stops a
    failed host's peers in mid-step, so the rollout decides here, once every peer of the batch
    has finished or failed on its own."""
    batch = list(batch)
    survivors = set(survivors)
    lost = [h for h in batch if h not in survivors]
    percent = 100.0 * len(lost) / len(batch) if batch else 0.0
    stop = percent > int(max_fail_percentage)
    message = (
        "%d of %d host(s) of this batch failed or were unreachable (%s): %.0f %% %s %d %%."
        % (
            len(lost),
            len(batch),
            _hosts(lost) if lost else "none",
            percent,
            "is more than rtfleet_max_fail_percentage"
            if stop
            else "is within rtfleet_max_fail_percentage",
            int(max_fail_percentage),
        )
    )
    if stop:
        message += " The rollout stops here: no later batch starts."
    return {"lost": lost, "percent": percent, "stop": stop, "message": message}
