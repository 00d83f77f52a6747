"""The sampler workload for Kubernetes: the figures its manifest takes from the plan records
of one host class (:func:`sampler_spec`), and the rules a sampler manifest must keep
(:func:`check_manifest`): the one implementation behind the samplers playbook, the
``rtfleet sampler-check`` command users run on manifests of their own, and the tests.

A sampler pod reaches the pinned shminfer units through one read-only ``hostPath`` mount of
the runtime's directory (``/run/shminfer``: each unit's registry and socket; the queues are
memfds handed over the socket), never the host's ``/dev/shm`` or IPC namespace. It is in
the runtime's group through ``supplementalGroups``, Guaranteed with integer CPUs (so the
static CPU Manager gives it CPUs of its own and the Topology Manager keeps them on one NUMA
node), runs as many math threads as it has CPUs, and ``Client.nearest()`` picks the unit
on its node.
"""

from __future__ import annotations

import json
import posixpath
import re

# The shminfer runtime's contract with its clients, as shminfer defines it (its own
# distribution, not importable here): the directory of every unit's registry and socket
# (shminfer.registry.DEFAULT_DIR), and every math library's thread count (the field reports'
# OMP/MKL/OpenBLAS lesson, and OpenVINO's CPU plugin), the variables the runtime's workers
# set to 1 and a sampler sets to its CPUs (shminfer.server.THREAD_ENV).
# tests/unit/test_sampler.py holds these equal to shminfer's.
RUN_DIR = "/run/shminfer"
THREAD_ENV = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "TBB_NUM_THREADS",
    "OV_CPU_THREADS_NUM",
)

KUBERNETES_VERSION = "1.31.0"
_TEMPLATED = {
    "Pod": ("spec",),
    "Deployment": ("spec", "template", "spec"),
    "StatefulSet": ("spec", "template", "spec"),
    "DaemonSet": ("spec", "template", "spec"),
    "ReplicaSet": ("spec", "template", "spec"),
    "Job": ("spec", "template", "spec"),
}
_MEMORY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_UNITS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_UNITS.update({"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40})


class SamplerError(ValueError):
    """A host class the manifest cannot serve, or settings it cannot take: one line."""


def sampler_spec(hosts: dict, *, threads: int, replicas_per_unit: int, memory_mib: int) -> dict:
    """The manifest's figures for one host class.

    ``hosts``: ``{host: {"plan": plan record, "gid": runtime group id, "uid": runtime
    user id}}``. Every host must have the same number of units and the runtime's ids (a
    pod's ``supplementalGroups`` is a number, valid on every node the pod may land on), and
    the pod pool of each unit's sampler CPUs must hold its samplers' CPUs.
    """
    if not hosts:
        raise SamplerError("no host in this class has a plan record: run the host step first")
    for name, value in (("threads", threads), ("replicas_per_unit", replicas_per_unit)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SamplerError(f"rtfleet_sampler_{name} must be an integer >= 1, got {value!r}")
    if isinstance(memory_mib, bool) or not isinstance(memory_mib, int) or memory_mib < 16:
        raise SamplerError(
            f"rtfleet_sampler_memory_mib must be an integer >= 16, got {memory_mib!r}"
        )
    ids = {}
    for key in ("gid", "uid"):
        seen = {host: info[key] for host, info in sorted(hosts.items())}
        if len(set(seen.values())) > 1:
            shown = ", ".join(f"{h} {v}" for h, v in seen.items())
            raise SamplerError(
                f"the runtime's {key} differs between hosts of this class ({shown}): set "
                f"rtfleet_runtime_{key} so one manifest fits every node"
            )
        ids[key] = next(iter(seen.values()))
    units = {host: len(info["plan"]["runtime_groups"]) for host, info in sorted(hosts.items())}
    if len(set(units.values())) > 1:
        raise SamplerError(
            f"hosts of this class run different numbers of units ({units}): give them "
            "different host classes (rtfleet_host_class)"
        )
    warnings = []
    for host, info in sorted(hosts.items()):
        warnings += _check_room(host, info["plan"], threads, replicas_per_unit)
    per_host = next(iter(units.values())) * replicas_per_unit
    return {
        "replicas": per_host * len(hosts),
        "replicas_per_host": per_host,
        "threads": threads,
        "memory_mib": memory_mib,
        "gid": ids["gid"],
        "server_uid": ids["uid"],
        "hosts": sorted(hosts),
        "run_dir": RUN_DIR,
        "thread_env": list(THREAD_ENV),
        "warnings": warnings,
    }


_CLASS = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")


# What a host's inventory says about its class's samplers (playbooks/samplers.yml reads
# each from the host's rtfleet_sampler_* variables); the spec's figures, then the template's.
DEFAULT_SETTINGS = {
    "threads": 1,
    "replicas_per_unit": 1,
    "memory_mib": 512,
    "kind": "Job",
    "namespace": "rtfleet",
    "image": "localhost/rtfleet-sampler:latest",
    "command": ["shminfer", "smoke", "--requests", "2000"],
    "uid": 65534,
}
_KINDS = ("Job", "Deployment")


def sampler_classes(records) -> list:
    """One entry per host class, sorted: ``{"host_class", "spec", "settings",
    "node_names"}``, or ``{"host_class", "skipped", "node_names"}`` for a class whose
    hosts have no pod pool.

    ``records``: ``[{"host", "host_class", "node_name", "plan", "gid", "uid", "settings"}]``,
    one per tuned host; ``settings`` are its ``rtfleet_sampler_*`` variables
    (:data:`DEFAULT_SETTINGS` fills the missing ones), which every host of a class must
    share: one manifest serves them all.
    """
    classes = {}
    for record in records:
        name = str(record.get("host_class") or "")
        if not _CLASS.match(name):
            raise SamplerError(
                f"{record.get('host')}: rtfleet_host_class {name!r} must be 1-40 lowercase "
                "letters, digits or '-' (it names the workload)"
            )
        classes.setdefault(name, []).append(record)
    out = []
    for name, members in sorted(classes.items()):
        hosts = {m["host"]: m for m in members}
        nodes = sorted(str(m.get("node_name") or m["host"]) for m in members)
        if not any(m["plan"].get("pod_pool") for m in members):
            # Runtime-only nodes: the policy leaves no CPU for pods, so no sampler goes here.
            out.append(
                {
                    "host_class": name,
                    "skipped": "no pod-pool CPU on its hosts (the policy gives every CPU to "
                    "housekeeping or the runtime): no sampler manifest",
                    "node_names": nodes,
                }
            )
            continue
        try:
            settings = _class_settings(hosts)
            spec = sampler_spec(
                hosts,
                threads=settings["threads"],
                replicas_per_unit=settings["replicas_per_unit"],
                memory_mib=settings["memory_mib"],
            )
        except SamplerError as exc:
            raise SamplerError(f"host class {name}: {exc}") from None
        out.append({"host_class": name, "spec": spec, "settings": settings, "node_names": nodes})
    return out


def _class_settings(hosts) -> dict:
    per_host = {
        host: {
            **DEFAULT_SETTINGS,
            **{k: v for k, v in (info.get("settings") or {}).items() if v is not None},
        }
        for host, info in sorted(hosts.items())
    }
    for settings in per_host.values():  # -e and INI inventories give numbers as text
        for key in ("threads", "replicas_per_unit", "memory_mib", "uid"):
            if isinstance(settings[key], str) and settings[key].strip().isdigit():
                settings[key] = int(settings[key])
    first_host, settings = next(iter(per_host.items()))
    for host, other in per_host.items():
        for key, value in settings.items():
            if other[key] != value:
                raise SamplerError(
                    f"hosts {first_host} and {host} disagree on rtfleet_sampler_{key} "
                    f"({value!r}, {other[key]!r}): one manifest serves a class, so set it for "
                    "the class (group_vars), or give them different rtfleet_host_class"
                )
    if settings["kind"] not in _KINDS:
        raise SamplerError(
            f"rtfleet_sampler_kind must be one of {list(_KINDS)}, got {settings['kind']!r}"
        )
    if (
        isinstance(settings["uid"], bool)
        or not isinstance(settings["uid"], int)
        or settings["uid"] < 1
    ):
        raise SamplerError(
            f"rtfleet_sampler_uid must be a user id >= 1 (runAsNonRoot), got {settings['uid']!r}"
        )
    command = settings["command"]
    if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
        raise SamplerError(f"rtfleet_sampler_command must be a list of strings, got {command!r}")
    return settings


def check_manifest_text(text: str, **options) -> list:
    """:func:`check_manifest` of a YAML file's text; bad YAML is one error."""
    import yaml  # noqa: PLC0415

    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        return [f"not YAML: {' '.join(str(exc).split())}"]
    if not any(isinstance(d, dict) for d in docs):
        return ["no Kubernetes object in it"]
    return check_manifest([d for d in docs if isinstance(d, dict)], **options)


def _check_room(host, plan, threads, replicas_per_unit) -> list:
    """Each unit's samplers fit in the pod-pool CPUs nearest to it (its node's, else its
    package's), shared with the other units that draw on the same CPUs, and all of them in
    the pod pool. A unit with no pod-pool CPU on its node or package (a socket the policy
    gives wholly to the runtime) is a warning: its samplers run across the socket link."""
    warnings, sharing = [], {}
    for group in plan["runtime_groups"]:
        if str(group.get("sampler_cpus_from", "")).startswith("pod_pool"):
            sharing.setdefault(tuple(group["sampler_cpus"]), []).append(group["name"])
        else:
            warnings.append(
                f"{host}: unit {group['name']} has no pod-pool CPU on its node or package: its "
                "samplers reach it across sockets (Client.nearest logs a warning)"
            )
    for cpus, names in sorted(sharing.items()):
        need = len(names) * replicas_per_unit * threads
        if need > len(cpus):
            raise SamplerError(
                f"{host}: units {','.join(names)} share {len(cpus)} pod-pool CPUs, and "
                f"{replicas_per_unit} sampler(s) x {threads} thread(s) each need {need}: "
                "lower rtfleet_sampler_threads or rtfleet_sampler_replicas_per_unit"
            )
    need = len(plan["runtime_groups"]) * replicas_per_unit * threads
    if need > len(plan.get("pod_pool") or []):
        raise SamplerError(
            f"{host}: {need} sampler CPUs for {len(plan['runtime_groups'])} units, and the pod "
            f"pool has {len(plan.get('pod_pool') or [])}: lower rtfleet_sampler_threads or "
            "rtfleet_sampler_replicas_per_unit"
        )
    return warnings


def _memory_bytes(text):
    match = _MEMORY.match(str(text))
    return int(match.group(1)) * _UNITS[match.group(2)] if match else None


def _dig(doc, path):
    for key in path:
        doc = doc.get(key) if isinstance(doc, dict) else None
    return doc


def check_manifest(docs, *, gid: int, run_dir: str = RUN_DIR, version=KUBERNETES_VERSION) -> list:
    """Every rule a sampler manifest breaks, one line each (empty: it keeps them all).

    ``docs``: the manifest's YAML documents. Each must validate against Kubernetes'
    schemas (kubernetes-validate, strict); each pod template must be Guaranteed with
    integer CPUs, mount ``run_dir`` and no other host path read-only, list ``gid`` in
    ``supplementalGroups``, keep ``hostIPC`` off, its root filesystem read-only, add no
    capability and set every math library's threads to its CPUs.
    """
    try:
        import kubernetes_validate  # noqa: PLC0415 - only the checks need the schemas
    except ImportError:
        raise SamplerError(
            "kubernetes-validate is not installed in this Python: pip install "
            "'rtfleet[kubernetes]' (make setup installs it)"
        ) from None

    errors = []
    for index, doc in enumerate(d for d in docs if d):
        kind = doc.get("kind", "?")
        where = f"{kind}/{_dig(doc, ('metadata', 'name')) or index}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path) or "(top)"
            errors.append(f"{where}: {path}: {exc.message} (Kubernetes {version} schema)")
            continue
        except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError):
            errors.append(f"{where}: no Kubernetes {version} schema for {kind}")
            continue
        if kind in _TEMPLATED:
            errors += _check_pod(where, _dig(doc, _TEMPLATED[kind]) or {}, gid, run_dir)
    return errors


def _check_pod(where, spec, gid, run_dir):
    errors = []
    want = posixpath.normpath(run_dir)
    if spec.get("hostIPC") or spec.get("hostPID") or spec.get("hostNetwork"):
        shared = [k for k in ("hostIPC", "hostPID", "hostNetwork") if spec.get(k)]
        errors.append(f"{where}: {', '.join(shared)}: true shares the host's; remove it")
    run_volumes, others = set(), False
    for volume in spec.get("volumes") or []:
        host_path = _dig(volume, ("hostPath", "path"))
        if host_path is None:
            continue
        if posixpath.normpath(host_path) != want:
            others = True
            errors.append(
                f"{where}: volume {volume['name']} mounts the host's {host_path}: a sampler "
                f"mounts only {want} (the runtime's directory)"
            )
        else:
            run_volumes.add(volume["name"])
    if not run_volumes and not others:
        errors.append(
            f"{where}: no volume mounts the host's {want} (hostPath): "
            "the sampler cannot reach a unit"
        )
    groups = _dig(spec, ("securityContext", "supplementalGroups")) or []
    if gid not in groups:
        errors.append(
            f"{where}: securityContext.supplementalGroups {groups} lacks the runtime's group "
            f"{gid}: the sampler could not read a unit's registry"
        )
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        errors += _check_container(
            f"{where} container {container.get('name')}", container, run_volumes, want
        )
    return errors


def _check_container(where, container, run_volumes, run_dir):
    errors = []
    limits = _dig(container, ("resources", "limits")) or {}
    requests = _dig(container, ("resources", "requests")) or limits
    cpu = str(limits.get("cpu", ""))
    if not cpu or not cpu.isdigit() or int(cpu) < 1:
        errors.append(
            f"{where}: resources.limits.cpu {cpu or 'unset'} is not a whole number of "
            "CPUs (Guaranteed, exclusive CPUs)"
        )
    elif str(requests.get("cpu", cpu)) != cpu:
        errors.append(
            f"{where}: requests.cpu {requests.get('cpu')} != limits.cpu {cpu} (not Guaranteed)"
        )
    memory = limits.get("memory")
    if memory is None:
        errors.append(f"{where}: resources.limits.memory is unset (not Guaranteed)")
    elif _memory_bytes(requests.get("memory", memory)) != _memory_bytes(memory):
        errors.append(
            f"{where}: requests.memory {requests.get('memory')} != limits.memory "
            f"{memory} (not Guaranteed)"
        )
    context = container.get("securityContext") or {}
    if context.get("readOnlyRootFilesystem") is not True:
        errors.append(f"{where}: securityContext.readOnlyRootFilesystem must be true")
    if context.get("allowPrivilegeEscalation") is not False or context.get("privileged"):
        errors.append(
            f"{where}: securityContext.allowPrivilegeEscalation must be false (and not privileged)"
        )
    added = _dig(context, ("capabilities", "add")) or []
    if added:
        errors.append(f"{where}: securityContext.capabilities.add {added}: a sampler needs none")
    for mount in container.get("volumeMounts") or []:
        if mount.get("name") in run_volumes:
            if not mount.get("readOnly"):
                errors.append(
                    f"{where}: volumeMount {mount['name']} of {run_dir} must be readOnly: true"
                )
            path = mount.get("mountPath", "")
            if posixpath.normpath(path) != run_dir and not _sets_dir(container, path):
                errors.append(
                    f"{where}: mounts {run_dir} at {path}: mount it at {run_dir}, or set "
                    f"SHMINFER_DIR={path}"
                )
    if cpu.isdigit():
        env = {e.get("name"): e.get("value") for e in container.get("env") or []}
        wrong = [name for name in THREAD_ENV if env.get(name) != cpu]
        if wrong:
            errors.append(
                f"{where}: {', '.join(wrong)} must be {cpu} (its CPUs), "
                f"not {[env.get(n) for n in wrong]}"
            )
    return errors


def _sets_dir(container, path):
    return any(
        e.get("name") == "SHMINFER_DIR" and e.get("value") == path
        for e in container.get("env") or []
    )


def podman_argv_text(text: str, **options) -> list:
    """:func:`podman_argv` of the manifest file's first workload."""
    import yaml  # noqa: PLC0415

    docs = [
        d for d in yaml.safe_load_all(text) if isinstance(d, dict) and d.get("kind") in _TEMPLATED
    ]
    if not docs:
        raise SamplerError("no workload with a pod template in the manifest")
    return podman_argv(docs[0], **options)


def podman_argv(doc: dict, *, cpus, mems, image=None, name="rtfleet-sampler") -> list:
    """``podman run`` arguments that give one replica of the manifest's pod what a kubelet
    with the static CPU Manager and the Memory Manager would: the pod's user, groups,
    mounts, environment, read-only root, capabilities and memory limit, on ``cpus`` (as
    many as the container's whole-CPU limit) with memory on NUMA nodes ``mems``. Its own
    IPC namespace and no network (the sampler needs neither). The lab runs it where no
    kubelet can be had; the argv is the manifest's, so what runs is what was checked."""
    kind = doc.get("kind")
    if kind not in _TEMPLATED:
        raise SamplerError(f"{kind}: not a workload with a pod template")
    spec = _dig(doc, _TEMPLATED[kind]) or {}
    (container, *more) = spec.get("containers") or [None]
    if container is None or more:
        raise SamplerError("the pod must have exactly one container to run it with podman")
    cpu = str(_dig(container, ("resources", "limits", "cpu")) or "")
    cpus = sorted(int(c) for c in cpus)
    if not cpu.isdigit() or int(cpu) != len(cpus):
        raise SamplerError(f"the container's CPU limit {cpu or 'unset'} is not {len(cpus)} CPUs")
    pod_context = spec.get("securityContext") or {}
    context = container.get("securityContext") or {}
    user = context.get("runAsUser", pod_context.get("runAsUser"))
    group = context.get("runAsGroup", pod_context.get("runAsGroup", user))
    argv = ["podman", "run", "--rm", "--name", name, "--network=none", "--ipc=private"]
    argv += ["--cpuset-cpus=" + ",".join(map(str, cpus))]
    argv += ["--cpuset-mems=" + ",".join(str(int(m)) for m in sorted(set(mems)))]
    if user is not None:
        argv += [f"--user={int(user)}:{int(group)}"]
    argv += [f"--group-add={int(g)}" for g in pod_context.get("supplementalGroups") or []]
    memory = _memory_bytes(_dig(container, ("resources", "limits", "memory")))
    if memory:
        argv += [f"--memory={memory}"]
    if context.get("readOnlyRootFilesystem"):
        argv += ["--read-only"]
    if context.get("allowPrivilegeEscalation") is False:
        argv += ["--security-opt=no-new-privileges"]
    if "ALL" in (_dig(context, ("capabilities", "drop")) or []):
        argv += ["--cap-drop=all"]
    argv += [f"--cap-add={c}" for c in _dig(context, ("capabilities", "add")) or []]
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    for mount in container.get("volumeMounts") or []:
        volume = volumes.get(mount["name"], {})
        target = mount["mountPath"]
        if "hostPath" in volume:
            mode = "ro" if mount.get("readOnly") else "rw"
            argv += [f"--volume={volume['hostPath']['path']}:{target}:{mode}"]
        elif "emptyDir" in volume:
            size = _memory_bytes(volume["emptyDir"].get("sizeLimit") or "64Mi")
            argv += [f"--tmpfs={target}:rw,size={size},mode=1777"]
        else:
            raise SamplerError(f"volume {mount['name']}: only hostPath and emptyDir run here")
    for var in container.get("env") or []:
        argv += ["--env", f"{var['name']}={var.get('value', '')}"]
    if container.get("command"):  # Kubernetes' command replaces the image's entrypoint
        argv += ["--entrypoint=" + json.dumps(container["command"])]
    return [*argv, image or container["image"], *(container.get("args") or [])]
