"""Optional Ray integration (``pip install 'shminfer[ray]'``).

The field reports' samplers talk to an inference Ray actor. ``InferenceActor`` keeps that
shape but moves the work out of the actor process: the actor only owns the queue and the
isolated, pinned worker (a shminfer :class:`~shminfer.server.Server`), and hands samplers
the server name; samplers on the same node then call the worker through shared memory::

    actor = InferenceActor.options(name="infer-ccx0").remote("ccx0", cpus=[2, 3], ...)
    client = shminfer.Client(ray.get(actor.endpoint.remote()))   # the one-line switch
    outputs = client.infer({"obs": obs})

Ray's gRPC threads stay in the actor process, never on the worker's CPU.
"""

from __future__ import annotations

import threading

from shminfer.server import Server

try:
    import ray
except ImportError:  # pragma: no cover - exercised only where Ray is installed
    ray = None


class InferenceActorImpl:
    def __init__(self, name, cpus, *, numa_node=-1, backend="openvino", model=None, **options):
        self.server = Server(
            name, cpus, numa_node=numa_node, backend=backend, model=model, worker_options=options
        )
        self.server.start()
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def endpoint(self) -> str:
        return self.server.name

    def restarts(self) -> dict:
        return dict(self.server.restarts)

    def shutdown(self) -> None:
        self.server._stop.set()
        self._thread.join()
        self.server.stop()


InferenceActor = ray.remote(num_cpus=0)(InferenceActorImpl) if ray is not None else None
