"""rtfleet's host-side code on a tuned node (/usr/local/lib/rtfleet/rtfleet_node): the
rtfleet.fleet collection's module_utils topology, boot, hosttune and drift, installed by the
rtfleet_host role for rtfleet-host-tune and rtfleet-drift."""
