"""The drift guard on a tuned host (rtfleet-drift, roles/rtfleet_host).

Operators: the guard's timer runs and finds nothing after a rollout. The drill below it
changes the host on purpose (an IRQ moved to an isolated CPU, a sysctl, irqbalance started
where the role stopped it) and puts it back, so it runs only when RTFLEET_DRIFT_DRILL=1 is
set (the lab's `site` scenario sets it): the guard must report each drift, re-pin the IRQ
and update its Prometheus textfile, and after the restore find no drift again.

A new IRQ-using device is not part of the drill: the lab's QEMU has no monitor to hot-plug
one into, so the IRQ is moved by hand (the guard reads every IRQ in /proc/irq on each run,
so one that appeared after boot is the same case; the unit tests have one).
"""

from __future__ import annotations

import os

import pytest
from rtfleet_infra import GUARD, drift_guard

from ansible_collections.rtfleet.fleet.plugins.module_utils.cpulist import (
    format_cpulist,
    parse_cpulist,
)

DRILL = os.environ.get("RTFLEET_DRIFT_DRILL") == "1"


def _drifted(result):
    return sorted(n for n, c in result["checks"].items() if c["status"] == "drift")


def _details(result):
    return {n: result["checks"][n]["details"] for n in _drifted(result)}


def test_drift_timer_is_enabled_and_waiting(host):
    shown = host.run(
        "systemctl is-enabled rtfleet-drift.timer; systemctl is-active rtfleet-drift.timer; "
        "stat -c %%a %s" % GUARD
    ).stdout.split()
    assert shown == ["enabled", "active", "755"]


def test_no_drift_after_the_rollout(host):
    rc, result, _, _ = drift_guard(host, "--check")
    assert rc == 0 and not _drifted(result), _details(result)
    assert result["checks"]["unit_threads"]["status"] in ("ok", "skipped")


STAMP = ("rtfleet_check_last_success_timestamp_seconds", (("tool", "rtfleet-drift"),))
REPINNED = ("rtfleet_drift_repinned_irqs_total", ())

# Moves the first device IRQ the tuner pinned (to the housekeeping cpulist) that takes the
# new CPU,
# raises a sysctl, starts irqbalance; prints what it did.
_CAUSE = r"""
for d in /proc/irq/[0-9]*; do
  n=${d##*/}; case " %(unmovable)s " in *" $n "*) continue;; esac
  [ -n "$(find $d -mindepth 1 -maxdepth 1 -type d)" ] || continue
  [ "$(cat $d/smp_affinity_list)" = "%(housekeeping)s" ] || continue
  echo %(cpu)d > $d/smp_affinity_list 2>/dev/null || continue
  [ "$(cat $d/smp_affinity_list)" = "%(cpu)d" ] && { echo "moved=$n"; break; }
done
sysctl -qw %(sysctl)s=%(value)d && echo sysctl=set
systemctl start irqbalance.service && [ "$(systemctl is-active irqbalance.service)" = active ] \
  && echo irqbalance=started
"""


@pytest.mark.skipif(not DRILL, reason="changes the host on purpose: set RTFLEET_DRIFT_DRILL=1")
def test_drift_is_detected_irqs_repinned_and_the_textfile_updated(
    host, rtfleet_plan, rtfleet_host_config
):
    isolated = rtfleet_plan["isolated"][-1]  # the highest isolated CPU (47 on the server host)
    housekeeping = format_cpulist(rtfleet_plan["housekeeping"])
    sysctl = "vm.swappiness"
    # The recorded value is the running one: the first guard run below finds no drift.
    swappiness = int(rtfleet_host_config["sysctls"][sysctl])
    # No timer run in the middle of the drill; a repairing run first, so the textfile exists.
    rc, before, _, metrics = drift_guard(host, before="systemctl stop rtfleet-drift.timer; ")
    try:
        assert rc == 0, _details(before)
        cause = _CAUSE % {
            "unmovable": " ".join(map(str, before["checks"]["irqs"]["unmovable"])),
            "housekeeping": housekeeping,
            "cpu": isolated,
            "sysctl": sysctl,
            "value": swappiness + 50,
        }
        run = host.run(cause)
        did = dict(line.split("=", 1) for line in run.stdout.split() if "=" in line)
        # Each step of the drill must have changed the host: a step that did nothing proves
        # nothing about the guard (the lab image has irqbalance, as a stock server has).
        assert "moved" in did, "no IRQ could be moved to CPU %d: %s" % (isolated, run.stderr)
        assert "sysctl" in did, "%s could not be set: %s" % (sysctl, run.stderr)
        assert "irqbalance" in did, "irqbalance could not be started: %s" % run.stderr
        moved = int(did["moved"])
        rc, found, log, after = drift_guard(host)
        assert rc == 1
        assert _drifted(found) == ["irqbalance", "sysctls"], found["checks"]
        irqs = found["checks"]["irqs"]
        assert irqs["status"] == "repaired", irqs
        repinned = {m["irq"]: m for m in irqs["repinned"]}
        assert repinned[moved]["from"] == str(isolated) and repinned[moved]["to"] == housekeeping
        assert "re-pinned IRQ %d" % moved in log
        wanted = "%s is %d, wanted %d" % (sysctl, swappiness + 50, swappiness)
        assert wanted in found["checks"]["sysctls"]["details"]
        assert after[("rtfleet_drift", (("check", "sysctls"),))] == 1
        assert after[("rtfleet_drift", (("check", "irqs"),))] == 0  # repaired
        assert after[REPINNED] >= metrics[REPINNED] + 1
        assert after[STAMP] > metrics[STAMP]
    finally:
        # Put the host back, then one repairing run: it rewrites the textfile, and puts back
        # IRQs a running irqbalance may have moved meanwhile. After it, a check finds nothing.
        restore = "sysctl -qw %s=%d; " % (sysctl, swappiness)
        if "irqbalance" in locals().get("did", {}):
            restore += "systemctl stop irqbalance.service; "
        restore += "%s >/dev/null 2>&1; systemctl start rtfleet-drift.timer; " % GUARD
        rc, clean, _, metrics = drift_guard(host, "--check", before=restore)
    assert rc == 0 and not _drifted(clean), _details(clean)
    assert not [k for k, v in metrics.items() if k[0] == "rtfleet_drift" and v]
    state = host.run(
        "sysctl -n %s; systemctl is-active irqbalance.service; "
        "systemctl is-active rtfleet-drift.timer; cat /proc/irq/%d/smp_affinity_list"
        % (sysctl, moved)
    ).stdout.split()
    assert state[:3] == [str(swappiness), state[1], "active"] and state[1] != "active", state
    assert parse_cpulist(state[3]) == rtfleet_plan["housekeeping"]  # re-pinned, and stays
