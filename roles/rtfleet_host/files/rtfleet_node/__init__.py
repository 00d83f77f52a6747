"""rtfleet's host-side code on a tuned node (/usr/local/lib/rtfleet/rtfleet_node): the
rtfleet.fleet collection's module_utils hosttune and drift (with drift_checks, drift_host,
drift_units) and the cpulist, plan_record and boot they use, installed by the rtfleet_host role for
rtfleet-host-tune and rtfleet-drift. Every other file here is a link into plugins/module_utils,
their one home."""
