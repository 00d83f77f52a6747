"""shminfer: a shared-memory inference runtime for CPU workers pinned to one CCX.

Samplers hand ndarray dicts to pinned worker processes through POSIX shared memory: no
serialisation, no scheduler in the way. See README.md ("shminfer") for the design.
"""

from shminfer.client import Client, InferenceError, ServerStopped

__all__ = ["Client", "InferenceError", "ServerStopped"]
__version__ = "0.2.0"
