"""rtfleet: tuned bare metal + Kubernetes for low-latency CPU inference fleets."""

__version__ = "0.1.0"
