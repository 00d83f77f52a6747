"""Ray for real, on a local Ray instance: sampler actors reach a pinned unit through
``shminfer.Client``, and the field reports' isolated design (an actor that owns the queue
and a pinned worker, ``shminfer.ray_actor.InferenceActor``) serves them.

Ray is an optional extra (``shminfer[ray]``); requirements/dev.txt installs it, so these run
in ``make unit`` and CI, where a missing Ray is an error rather than a skip.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from shminfer_serving import CPUS, serving

from shminfer.registry import registry_path

# A single-node Ray on loopback only (Ray otherwise binds its services to this machine's
# interface address), and no usage report.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
try:
    import ray
except ImportError:  # pragma: no cover - only where Ray cannot install
    ray = None

pytestmark = pytest.mark.skipif(
    ray is None and os.environ.get("CI") != "true",
    reason="Ray is not installed (pip install 'shminfer[ray]'); CI installs it",
)

WIDTH = 4096


class SamplerImpl:
    """A sampler as a Ray actor: one shminfer client, chosen by name or by locality."""

    def __init__(self, name=None, match=None):
        from shminfer import Client

        if match is not None:
            self.client = Client.nearest(match=match, timeout=30)
        else:
            self.client = Client(name, timeout=30)
        self.client.wait_ready(120)

    def unit(self):
        return self.client.name

    def step(self, seed):
        x = np.full((1, WIDTH), seed, dtype=np.float32)
        y = self.client.infer({"x": x})["y"]
        return bool(np.array_equal(y, np.concatenate([x, x], axis=-1))), os.getpid()


@pytest.fixture(scope="module")
def local_ray():
    if ray is None:
        pytest.fail(
            "Ray is not installed: pip install 'shminfer[ray]' (requirements/dev.txt has it)"
        )
    here = os.path.dirname(os.path.abspath(__file__))
    ray.init(
        # The actor classes live in this module: Ray's workers import it by name.
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([here, os.path.dirname(here)])}},
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=100 << 20,
        namespace="rtfleet-tests-%d" % os.getpid(),
    )
    yield ray
    ray.shutdown()


def test_sampler_actors_get_their_own_answers_from_a_pinned_unit(local_ray):
    sampler = ray.remote(num_cpus=0)(SamplerImpl)
    name = "ray%ds" % os.getpid()
    with serving(name=name, cpus=CPUS[-1:]):
        by_name = sampler.remote(name)
        by_locality = sampler.remote(match=name)
        assert ray.get(by_locality.unit.remote(), timeout=120) == name
        calls = [a.step.remote(seed) for seed in range(40) for a in (by_name, by_locality)]
        answers = ray.get(calls, timeout=120)
        assert all(ok for ok, _pid in answers), "a sampler got an answer that was not its own"
        pids = {pid for _ok, pid in answers}
        assert len(pids) == 2 and os.getpid() not in pids  # two actor processes
        for actor in (by_name, by_locality):
            ray.kill(actor)


def test_the_isolated_design_an_actor_owning_queue_and_pinned_worker(local_ray):
    from shminfer.ray_actor import InferenceActor

    name = "ray%di" % os.getpid()
    owner = InferenceActor.options(name="infer-" + name).remote(
        name, CPUS[-1:], backend="echo", sched="off"
    )
    endpoint = ray.get(owner.endpoint.remote(), timeout=120)
    assert endpoint == name and os.path.exists(registry_path(name))
    sampler = ray.remote(num_cpus=0)(SamplerImpl).remote(endpoint)
    answers = ray.get([sampler.step.remote(seed) for seed in range(30)], timeout=120)
    assert all(ok for ok, _pid in answers)
    assert not any(ray.get(owner.restarts.remote(), timeout=60).values())
    ray.kill(sampler)
    ray.get(owner.shutdown.remote(), timeout=120)
    assert not os.path.exists(registry_path(name)), "the actor left its server's files"
