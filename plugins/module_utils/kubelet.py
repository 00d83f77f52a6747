"""Kubelet CPU, Topology and Memory Manager configuration from the CPU partition plan.

One implementation, stdlib-only and Python 3.9-compatible, because it also ships to hosts
as Ansible module_utils (``plugins/module_utils/rtfleet_kubelet.py`` is a symlink to it)
for the ``kubelet_config`` module. It never touches a host itself:

* :func:`build` renders the KubeletConfiguration keys from a plan (``rtfleet.planner``),
  the topology (``rtfleet.topology``) and the role's settings, validates the effective
  configuration the way kubelet would, and decides whether the CPU / Memory Manager
  checkpoints must be reset;
* :func:`validate` holds the rules, each error saying what to change;
* :func:`state_reset` compares the previous and the new effective configuration.

Option maturity per kubelet minor version comes from kubelet's own tables
(pkg/kubelet/cm/cpumanager/policy_options.go, pkg/kubelet/cm/topologymanager/
policy_options.go) and the release notes; versions newer than the table are treated as
the newest version it knows, with a warning.
"""

from __future__ import annotations

import copy
import json
import re
from fractions import Fraction

from .cpulist import TopologyError, format_cpulist, parse_cpulist

API_VERSION = "kubelet.config.k8s.io/v1beta1"
KIND = "KubeletConfiguration"

MIN_VERSION = (1, 27)  # CPU Manager GA 1.26, Topology Manager GA 1.27
NEWEST_KNOWN_VERSION = (1, 36)

# First minor version at each maturity stage; absent stage = not reached (yet).
CPU_MANAGER_OPTIONS = {
    "full-pcpus-only": {"alpha": (1, 22), "beta": (1, 23), "ga": (1, 33)},
    "distribute-cpus-across-numa": {"alpha": (1, 23), "beta": (1, 33)},
    "align-by-socket": {"alpha": (1, 25)},
    "distribute-cpus-across-cores": {"alpha": (1, 31)},
    "strict-cpu-reservation": {"alpha": (1, 32), "beta": (1, 33), "ga": (1, 35)},
    "prefer-align-cpus-by-uncorecache": {"alpha": (1, 32), "beta": (1, 34), "ga": (1, 36)},
}
TOPOLOGY_MANAGER_OPTIONS = {
    "prefer-closest-numa-nodes": {"alpha": (1, 26), "beta": (1, 28), "ga": (1, 32)},
    "max-allowable-numa-nodes": {"beta": (1, 31), "ga": (1, 35)},
}
# The feature gate that must be on for any option at all, while it is not GA.
_OPTIONS_GATE = {
    "cpu": ("CPUManagerPolicyOptions", {"alpha": (1, 22), "beta": (1, 23), "ga": (1, 33)}),
    "topology": (
        "TopologyManagerPolicyOptions",
        {"alpha": (1, 26), "beta": (1, 28), "ga": (1, 32)},
    ),
}
_LEVEL_GATES = {
    "cpu": {"alpha": "CPUManagerPolicyAlphaOptions", "beta": "CPUManagerPolicyBetaOptions"},
    "topology": {
        "alpha": "TopologyManagerPolicyAlphaOptions",
        "beta": "TopologyManagerPolicyBetaOptions",
    },
}
# What rtfleet turns on by default once kubelet offers it as beta or GA: whole cores per
# container, no pod of any QoS class on reserved (housekeeping + runtime) CPUs, and exclusive
# CPUs packed into one L3 group (CCX) where they fit.
RECOMMENDED_CPU_OPTIONS = (
    "full-pcpus-only",
    "strict-cpu-reservation",
    "prefer-align-cpus-by-uncorecache",
)
# Pairs kubelet refuses together (NewStaticPolicyOptions).
CPU_OPTION_CONFLICTS = (
    ("full-pcpus-only", "distribute-cpus-across-cores"),
    ("distribute-cpus-across-numa", "distribute-cpus-across-cores"),
    ("prefer-align-cpus-by-uncorecache", "distribute-cpus-across-cores"),
    ("prefer-align-cpus-by-uncorecache", "distribute-cpus-across-numa"),
)
TOPOLOGY_POLICIES = ("none", "best-effort", "restricted", "single-numa-node")
TOPOLOGY_SCOPES = ("container", "pod")
MEMORY_POLICIES = ("None", "Static")
CPU_POLICIES = ("none", "static")
DEFAULT_MAX_NUMA_NODES = 8  # topology manager refuses more without max-allowable-numa-nodes
# Config-dir (drop-in) support: alpha 1.28 behind KUBELET_CONFIG_DROPIN_DIR_ALPHA in the
# kubelet's environment, beta (feature gate KubeletConfigDropinDir, on) 1.30, GA 1.35.
DROPIN_ALPHA = (1, 28)
DROPIN_DEFAULT = (1, 30)

DEFAULT_SETTINGS = {
    "kubelet_version": "1.31",
    "config_mode": "auto",  # auto | dropin | main
    "cpu_manager_policy": "static",
    # Added when beta or GA at the kubelet version, unless set in cpu_manager_policy_options.
    "recommended_cpu_options": True,
    "cpu_manager_policy_options": {},
    "cpu_manager_reconcile_period": "10s",
    "reserved_system_cpus": None,  # None: the plan's housekeeping + runtime CPUs
    "topology_manager_policy": "single-numa-node",
    "topology_manager_scope": "pod",
    "topology_manager_policy_options": {},
    "memory_manager_policy": "Static",
    "reserved_memory": "auto",  # "auto" (split evenly over NUMA nodes) or a list
    "kube_reserved": {"memory": "512Mi"},
    "system_reserved": {"memory": "512Mi"},
    "eviction_hard": {"memory.available": "100Mi"},
    "feature_gates": {},
    "allow_alpha_options": False,
    "extra": {},
}

_GO_BOOLS = {"1", "t", "T", "TRUE", "true", "True", "0", "f", "F", "FALSE", "false", "False"}
_BINARY_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL_SUFFIX = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)(?:([eE][+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)$")
_DURATION = re.compile(r"^(?:([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h))+$")
_DURATION_PART = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
_DURATION_NS = {"ns": 1, "us": 10**3, "µs": 10**3, "ms": 10**6, "s": 10**9, "m": 60 * 10**9}
_DURATION_NS["h"] = 3600 * 10**9
_HUGEPAGES = re.compile(r"^hugepages-([0-9]+(?:Ki|Mi|Gi))$")


# ------------------------------------------------------------------ feature gates
# Names kubelet registers, from kubernetes/kubernetes pkg/features/kube_features.go and
# versioned_kube_features.go at two commits: 0021731d (1.32 development: the 1.31 gates plus
# the new 1.32 ones) and b0b89d3b (1.33), including the k8s.io/apiserver, apiextensions,
# controller-manager and zpages gates those files register. kubelet refuses a name it does
# not know ("unrecognized feature gate"), so for kubelet 1.31-1.33 an unknown name is an
# error; outside those versions the table is not complete and an unknown name is a warning.
_GATES_1_31_TO_1_33 = frozenset(
    """
    APIResponseCompression APIServerIdentity APIServerTracing APIServingWithRoutine
    AllowDNSOnlyNodeCSR AllowInsecureKubeletCertificateSigningRequests
    AllowOverwriteTerminationGracePeriodSeconds AnonymousAuthConfigurableEndpoints
    AnyVolumeDataSource AuthorizeNodeWithSelectors AuthorizeWithSelectors
    CPUManagerPolicyAlphaOptions CPUManagerPolicyBetaOptions CPUManagerPolicyOptions
    CRDValidationRatcheting CSIMigrationPortworx CSIVolumeHealth CloudControllerManagerWebhook
    ClusterTrustBundle ClusterTrustBundleProjection ConcurrentWatchObjectDecode
    ConsistentListFromCache ContainerCheckpoint CoordinatedLeaderElection
    CronJobsScheduledAnnotation CrossNamespaceVolumeDataSource CustomCPUCFSQuotaPeriod
    CustomResourceFieldSelectors DevicePluginCDIDevices DisableAllocatorDualWrite
    DisableNodeKubeProxyVersion DynamicResourceAllocation ElasticIndexedJob EventedPLEG
    ExecProbeTimeout GracefulNodeShutdown GracefulNodeShutdownBasedOnPodPriority HPAScaleToZero
    HonorPVReclaimPolicy ImageMaximumGCAge ImageVolume InPlacePodVerticalScaling
    InTreePluginPortworxUnregister JobBackoffLimitPerIndex JobManagedBy JobPodReplacementPolicy
    JobSuccessPolicy KMSv1 KubeletCgroupDriverFromCRI KubeletFineGrainedAuthz
    KubeletInUserNamespace KubeletPodResourcesDynamicResources KubeletPodResourcesGet
    KubeletRegistrationGetOnExistsOnly KubeletSeparateDiskGC KubeletTracing LoadBalancerIPMode
    LocalStorageCapacityIsolationFSQuotaMonitoring LogarithmicScaleDown
    MatchLabelKeysInPodAffinity MatchLabelKeysInPodTopologySpread MaxUnavailableStatefulSet
    MemoryManager MemoryQoS MultiCIDRServiceAllocator MutatingAdmissionPolicy NFTablesProxyMode
    NodeInclusionPolicyInPodTopologySpread NodeLogQuery NodeSwap OpenAPIEnums
    PodAndContainerStatsFromCRI PodDeletionCost PodDisruptionConditions PodIndexLabel
    PodLifecycleSleepAction PodReadyToStartContainersCondition PodSchedulingReadiness
    PortForwardWebsockets ProcMountType QOSReserved RecoverVolumeExpansionFailure
    RecursiveReadOnlyMounts RelaxedDNSSearchValidation RelaxedEnvironmentVariableValidation
    ReloadKubeletServerCertificateFile ResilientWatchCacheInitialization ResourceHealthStatus
    RetryGenerateName RotateKubeletServerCertificate RuntimeClassInImageCriApi
    SELinuxChangePolicy SELinuxMount SELinuxMountReadWriteOncePod SchedulerQueueingHints
    SeparateCacheWatchRPC SeparateTaintEvictionController ServiceAccountTokenJTI
    ServiceAccountTokenNodeBinding ServiceAccountTokenNodeBindingValidation
    ServiceAccountTokenPodNodeInfo ServiceTrafficDistribution SidecarContainers
    SizeMemoryBackedVolumes StatefulSetAutoDeletePVC StatefulSetStartOrdinal
    StorageNamespaceIndex StorageVersionAPI StorageVersionHash StorageVersionMigrator
    StrictCostEnforcementForVAP StrictCostEnforcementForWebhooks
    StructuredAuthenticationConfiguration StructuredAuthorizationConfiguration
    SupplementalGroupsPolicy TopologyAwareHints TopologyManagerPolicyAlphaOptions
    TopologyManagerPolicyBetaOptions TopologyManagerPolicyOptions
    TranslateStreamCloseWebsocketRequests UnauthenticatedHTTP2DOSMitigation
    UnknownVersionInteroperabilityProxy UserNamespacesPodSecurityStandards
    UserNamespacesSupport VolumeAttributesClass WatchCacheInitializationPostStartHook
    WatchFromStorageWithoutResourceVersion WatchList WinDSR WinOverlay WindowsHostNetwork
""".split()  # noqa: SIM905
)
_GATES_UNTIL_1_32 = frozenset(  # gone from the 1.33 table
    """
    APIListChunking AdmissionWebhookMatchConditions AggregatedDiscoveryEndpoint AppArmor
    AppArmorFields CPUManager DisableCloudProviders DisableKubeletCloudCredentialProviders
    EfficientWatchResumption HPAContainerMetrics JobPodFailurePolicy
    KubeProxyDrainingTerminatingNodes PDBUnhealthyPodEvictionPolicy
    PersistentVolumeLastPhaseTransitionTime PodHostIPs RemainingItemCount
    VolumeCapacityPriority WatchBookmark ZeroLimitedNominalConcurrencyShares
""".split()  # noqa: SIM905
)
_GATES_FROM_1_33 = frozenset(
    """
    AggregatedDiscoveryRemoveBetaType AllowParsingUserUIDFromCertAuth
    AllowServiceLBStatusOnNonLB AllowUnsafeMalformedObjectDeletion BtreeWatchCache
    CBORServingAndStorage ComponentFlagz ComponentStatusz ContainerStopSignals DRAAdminAccess
    DRADeviceTaints DRAPartitionableDevices DRAPrioritizedList DRAResourceClaimDeviceStatus
    DeclarativeValidation DeclarativeValidationTakeover DeploymentReplicaSetTerminatingReplicas
    DisableCPUQuotaWithExclusiveCPUs ExternalServiceAccountTokenSigner GitRepoVolumeDriver
    HPAConfigurableTolerance InPlacePodVerticalScalingAllocatedStatus
    InPlacePodVerticalScalingExclusiveCPUs KubeletCrashLoopBackOffMax
    KubeletEnsureSecretPulledImages KubeletPSI KubeletServiceAccountTokenForCredentialProviders
    LegacySidecarContainers ListFromCacheSnapshot MutableCSINodeAllocatableCount
    OrderedNamespaceDeletion PodLevelResources PodLifecycleSleepActionAllowZero
    PodLogsQuerySplitStreams PodObservedGenerationTracking PodTopologyLabelsAdmission
    PreferSameTrafficDistribution ReduceDefaultCrashLoopBackOffDecay RemoteRequestHeaderUID
    SchedulerAsyncPreemption SchedulerPopFromBackoffQ ServiceAccountNodeAudienceRestriction
    StorageCapacityScoring StreamingCollectionEncodingToJSON
    StreamingCollectionEncodingToProtobuf StrictIPCIDRValidation SystemdWatchdog
    WindowsCPUAndMemoryAffinity WindowsGracefulNodeShutdown
""".split()  # noqa: SIM905
)
# Registered outside pkg/features: featuregate's AllAlpha/AllBeta, component-base/logs/api/v1
# and client-go's features (wired into kubelet's gate by AddFeaturesToExistingFeatureGates).
_GATES_COMPONENT = frozenset(
    """
    AllAlpha AllBeta ContextualLogging LoggingAlphaOptions LoggingBetaOptions ClientsAllowCBOR
    ClientsPreferCBOR InformerResourceVersion InOrderInformers WatchListClient
""".split()  # noqa: SIM905
)
GATE_TABLE_VERSIONS = ((1, 31), (1, 33))
# Gates locked to their default (LockToDefault, from the same two commits): kubelet refuses
# any other value ("cannot set feature gate X to false, feature is locked to true").
# name -> (first locked version, locked value). TopologyManagerPolicyOptions is GA in 1.32
# but not locked, so false is still accepted there.
LOCKED_FEATURE_GATES = {
    "CPUManager": ((1, 26), True),
    "MemoryManager": ((1, 32), True),
    "CPUManagerPolicyOptions": ((1, 33), True),
    "WatchBookmark": ((1, 17), True),
    "EfficientWatchResumption": ((1, 24), True),
    "APIListChunking": ((1, 29), True),
    "RemainingItemCount": ((1, 29), True),
    "AdmissionWebhookMatchConditions": ((1, 30), True),
    "AggregatedDiscoveryEndpoint": ((1, 30), True),
    "PodSchedulingReadiness": ((1, 30), True),
    "ZeroLimitedNominalConcurrencyShares": ((1, 30), True),
    "AppArmor": ((1, 31), True),
    "AppArmorFields": ((1, 31), True),
    "DevicePluginCDIDevices": ((1, 31), True),
    "DisableCloudProviders": ((1, 31), True),
    "DisableKubeletCloudCredentialProviders": ((1, 31), True),
    "ElasticIndexedJob": ((1, 31), True),
    "LogarithmicScaleDown": ((1, 31), True),
    "PodDisruptionConditions": ((1, 31), True),
    "StatefulSetStartOrdinal": ((1, 31), True),
    "AllowServiceLBStatusOnNonLB": ((1, 32), False),
    "CronJobsScheduledAnnotation": ((1, 32), True),
    "CustomResourceFieldSelectors": ((1, 32), True),
    "LoadBalancerIPMode": ((1, 32), True),
    "PodIndexLabel": ((1, 32), True),
    "RetryGenerateName": ((1, 32), True),
    "ServiceAccountTokenJTI": ((1, 32), True),
    "ServiceAccountTokenNodeBindingValidation": ((1, 32), True),
    "ServiceAccountTokenPodNodeInfo": ((1, 32), True),
    "SizeMemoryBackedVolumes": ((1, 32), True),
    "StatefulSetAutoDeletePVC": ((1, 32), True),
    "StrictCostEnforcementForVAP": ((1, 32), True),
    "StrictCostEnforcementForWebhooks": ((1, 32), True),
    "StructuredAuthorizationConfiguration": ((1, 32), True),
    "AnyVolumeDataSource": ((1, 33), True),
    "BtreeWatchCache": ((1, 33), True),
    "CRDValidationRatcheting": ((1, 33), True),
    "CSIMigrationPortworx": ((1, 33), True),
    "HonorPVReclaimPolicy": ((1, 33), True),
    "JobBackoffLimitPerIndex": ((1, 33), True),
    "JobSuccessPolicy": ((1, 33), True),
    "MatchLabelKeysInPodAffinity": ((1, 33), True),
    "NFTablesProxyMode": ((1, 33), True),
    "NodeInclusionPolicyInPodTopologySpread": ((1, 33), True),
    "RecursiveReadOnlyMounts": ((1, 33), True),
    "ServiceAccountTokenNodeBinding": ((1, 33), True),
    "ServiceTrafficDistribution": ((1, 33), True),
    "SidecarContainers": ((1, 33), True),
    "TopologyAwareHints": ((1, 33), True),
    "WatchFromStorageWithoutResourceVersion": ((1, 33), False),
}


def known_feature_gates(version):
    """The gate names kubelet ``version`` registers, or None when rtfleet's table lacks it."""
    first, last = GATE_TABLE_VERSIONS
    if not first <= version <= last:
        return None
    names = _GATES_1_31_TO_1_33 | _GATES_COMPONENT
    if version <= (1, 32):
        # The 1.32-development commit predates some 1.32 gates that the 1.33 table lists
        # (DRAAdminAccess, AllowServiceLBStatusOnNonLB): accept both tables' names there.
        return names | _GATES_UNTIL_1_32 | _GATES_FROM_1_33
    return names | _GATES_FROM_1_33


def _check_feature_gates(gates, version, errors):
    known = known_feature_gates(version)
    for gate, value in sorted(gates.items()):
        if known is not None and gate not in known:
            close = sorted(n for n in known if n.lower() == str(gate).lower())
            errors.append(
                "featureGates.%s: kubelet %d.%d has no such feature gate (it refuses to start: "
                "unrecognized feature gate)%s: fix or remove it in rtfleet_kubelet_feature_gates"
                % ((gate, *version, "; did you mean %s?" % close[0] if close else ""))
            )
            continue
        locked = LOCKED_FEATURE_GATES.get(gate)
        if locked and version >= locked[0] and isinstance(value, bool) and value != locked[1]:
            errors.append(
                "featureGates.%s=%s: the gate is locked to %s since kubelet %d.%d (%s), so kubelet "
                "refuses to start: remove it from rtfleet_kubelet_feature_gates"
                % (
                    gate,
                    str(value).lower(),
                    str(locked[1]).lower(),
                    *locked[0],
                    "GA" if locked[1] else "deprecated",
                )
            )


class KubeletConfigError(Exception):
    """Settings that cannot produce a kubelet configuration; the message says what to change."""


# ------------------------------------------------------------------ small parsers


def parse_version(text):
    """ "1.31", "v1.31.4", "1.31.0-rc.1" -> (1, 31)."""
    match = re.match(r"^v?(\d+)\.(\d+)(?:\.\d+)?(?:[-+].*)?$", str(text).strip())
    if not match:
        raise KubeletConfigError(
            'kubelet_version must look like "1.31" or "v1.31.4", got %r' % (text,)
        )
    return int(match.group(1)), int(match.group(2))


def parse_cpuset(text):
    """Kubelet's cpuset syntax (k8s.io/utils/cpuset Parse): sorted ints; ValueError if not.

    The strict mode of rtfleet's one cpulist parser: "" is empty, otherwise "N" / "N-M" items
    joined by "," with no spaces, no empty item ("0-3," fails) and no stride.
    """
    try:
        return parse_cpulist(str(text), "reservedSystemCPUs", strict=True)
    except TopologyError as exc:
        raise ValueError(str(exc).split(": ", 1)[-1]) from None


# [0, 1, 2, 8] -> "0-2,8": the same spelling kubelet uses.
format_cpuset = format_cpulist


def parse_quantity(value):
    """A Kubernetes resource quantity ("1Gi", "512M", "1e9", 1024) -> Fraction."""
    if isinstance(value, bool):
        raise ValueError("%r is not a quantity" % (value,))
    if isinstance(value, int):
        return Fraction(value)
    match = _QUANTITY.match(str(value).strip())
    if not match:
        raise ValueError("%r is not a quantity" % (value,))
    try:
        number = Fraction(match.group(1))
    except (ValueError, ZeroDivisionError):
        raise ValueError("%r is not a quantity" % (value,)) from None
    if match.group(2):
        return number * Fraction(10) ** int(match.group(2)[1:])
    suffix = match.group(3) or ""
    return number * (_BINARY_SUFFIX.get(suffix) or _DECIMAL_SUFFIX[suffix])


def format_bytes(amount):
    """Exact bytes -> the largest binary unit that divides them ("1536Mi")."""
    amount = int(amount)
    for suffix in ("Gi", "Mi", "Ki"):
        unit = _BINARY_SUFFIX[suffix]
        if amount and amount % unit == 0:
            return "%d%s" % (amount // unit, suffix)
    return str(amount)


def parse_duration(text):
    """A Go duration ("10s", "1m30s", "500ms") -> nanoseconds; ValueError when malformed."""
    text = str(text).strip()
    if text == "0":
        return 0
    if not _DURATION.match(text):
        raise ValueError("%r is not a duration" % text)
    return int(sum(Fraction(n) * _DURATION_NS[unit] for n, unit in _DURATION_PART.findall(text)))


def merge(base, override):
    """Kubelet's drop-in merge: maps merge key by key, lists and scalars replace."""
    result = copy.deepcopy(base) if isinstance(base, dict) else {}
    for key, value in (override or {}).items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def option_stage(table, name, version):
    """'alpha' | 'beta' | 'ga' for the option at this kubelet version, None if absent."""
    stages = table.get(name)
    if not stages:
        return None
    current = None
    for stage in ("alpha", "beta", "ga"):
        if stage in stages and version >= stages[stage]:
            current = stage
    return current


# ------------------------------------------------------------------ settings


def normalize_settings(settings):
    """Defaults + settings, type-checked; raises KubeletConfigError naming the key."""
    merged = copy.deepcopy(DEFAULT_SETTINGS)
    for key, value in (settings or {}).items():
        if key not in DEFAULT_SETTINGS:
            raise KubeletConfigError(
                "unknown kubelet setting %r; known settings: %s"
                % (key, ", ".join(sorted(DEFAULT_SETTINGS)))
            )
        if value is not None or key == "reserved_system_cpus":
            merged[key] = value
    for key in (
        "cpu_manager_policy_options",
        "topology_manager_policy_options",
        "kube_reserved",
        "system_reserved",
        "eviction_hard",
        "feature_gates",
        "extra",
    ):
        if not isinstance(merged[key], dict):
            raise KubeletConfigError(
                "%s must be a mapping, got %r" % (key, type(merged[key]).__name__)
            )
    for key in ("cpu_manager_policy_options", "topology_manager_policy_options"):
        # kubelet decodes these as map[string]string: YAML true must become "true".
        merged[key] = {
            str(k): (str(v).lower() if isinstance(v, bool) else str(v))
            for k, v in merged[key].items()
        }
    if merged["config_mode"] not in ("auto", "dropin", "main"):
        raise KubeletConfigError(
            "config_mode must be auto, dropin or main, got %r" % (merged["config_mode"],)
        )
    for key in ("allow_alpha_options", "recommended_cpu_options"):
        if not isinstance(merged[key], bool):
            raise KubeletConfigError("%s must be true or false" % key)
    if merged["reserved_memory"] != "auto" and not isinstance(merged["reserved_memory"], list):
        raise KubeletConfigError(
            'reserved_memory must be "auto" or a list of {numaNode: N, limits: {memory: 1Gi}}'
        )
    return merged


def config_target(version, mode):
    """(use_dropin, warnings) for this kubelet version and config_mode."""
    if mode == "main":
        return False, []
    if mode == "auto":
        return version >= DROPIN_DEFAULT, []
    if version < DROPIN_ALPHA:
        raise KubeletConfigError(
            "config_mode dropin needs kubelet >= 1.28 (--config-dir); kubelet %d.%d has no "
            "drop-in directory: set config_mode: main (or auto)" % version
        )
    if version < DROPIN_DEFAULT:
        return True, [
            "kubelet %d.%d reads --config-dir only with KUBELET_CONFIG_DROPIN_DIR_ALPHA set in "
            "its environment (alpha); make sure the kubelet unit sets it" % version
        ]
    return True, []


# ------------------------------------------------------------------ rendering


# kubelet's evictionHard defaulting (cmd/kubelet/app/server.go loadConfigFile): a main config
# file without evictionHard gets DefaultEvictionHard, whose memory.available is 100Mi on Linux
# (pkg/kubelet/eviction/defaults_linux.go); a map that is there, even empty, is kept as it is,
# unless mergeDefaultEvictionSettings is true (a field from 1.33; older kubelets decode it
# leniently and ignore it), which fills in the default signals it lacks. Drop-ins are merged
# over the main file as loaded, key by key. The Static Memory Manager counts memory.available
# in the reservation only when it is there.
DEFAULT_EVICTION_MEMORY = "100Mi"
MERGE_DEFAULT_EVICTION = (1, 33)


def _numa_nodes(topology):
    """Nodes with CPUs (where housekeeping, runtime and pods run)."""
    return [n for n in topology.get("numa_nodes", []) if n.get("cpus")]


def kubelet_numa_nodes(topology):
    """Every node kubelet sees (cadvisor lists each nodeN/ directory): CPU-less CXL nodes
    included, an offline memoryless node (no directory) not."""
    return [n for n in topology.get("numa_nodes", []) if n.get("online", True)]


def _reservable_nodes(topology):
    """Nodes the automatic reservedMemory split uses: kubelet-visible, with CPUs and memory."""
    return [
        n
        for n in kubelet_numa_nodes(topology)
        if n.get("cpus") and n.get("has_memory", True) and n.get("memory_kb") != 0
    ]


def _eviction_memory(config, version, base=None):
    """evictionHard memory.available as kubelet applies it, None when it applies none.

    ``config`` is kubelet's main config file, or, when ``base`` (the main file) is given, a
    drop-in (possibly already merged over ``base``).
    """
    main = config if base is None else base
    eviction = main.get("evictionHard")
    if eviction is None:
        eviction = {"memory.available": DEFAULT_EVICTION_MEMORY}
    elif version >= MERGE_DEFAULT_EVICTION and main.get("mergeDefaultEvictionSettings") is True:
        eviction = merge({"memory.available": DEFAULT_EVICTION_MEMORY}, eviction)
    if base is not None:
        eviction = merge(eviction, config.get("evictionHard") or {})
    return eviction.get("memory.available")


def _is_percentage(eviction):
    return eviction is not None and str(eviction).strip().endswith("%")


def _memory_reservation_total(config, version, base=None):
    """Per resource (memory, hugepages-*): kubeReserved + systemReserved + evictionHard."""
    totals = {}
    for section in ("kubeReserved", "systemReserved"):
        for name, value in (config.get(section) or {}).items():
            if name == "memory" or _HUGEPAGES.match(name):
                totals[name] = totals.get(name, Fraction(0)) + parse_quantity(value)
    eviction = _eviction_memory(config, version, base)
    if eviction is not None and not _is_percentage(eviction):
        totals["memory"] = totals.get("memory", Fraction(0)) + parse_quantity(eviction)
    return totals


def _auto_reserved_memory(config, topology, version, base=None):
    """Split each reserved memory type evenly over the NUMA nodes (node 0 takes the rest)."""
    nodes = [n["id"] for n in _reservable_nodes(topology)] or [0]
    eviction = _eviction_memory(config, version, base)
    if _is_percentage(eviction):
        raise KubeletConfigError(
            "evictionHard memory.available is %s (a percentage), but the Static Memory Manager "
            "needs reservedMemory to sum to an exact amount: give eviction_hard "
            'memory.available an absolute quantity such as "500Mi"' % str(eviction).strip()
        )
    try:
        totals = _memory_reservation_total(config, version, base)
    except ValueError as exc:
        raise KubeletConfigError("kube_reserved/system_reserved/eviction_hard: %s" % exc) from None
    per_node = {node: {} for node in nodes}
    for name, total in sorted(totals.items()):
        if total.denominator != 1:
            raise KubeletConfigError(
                "reserved %s adds up to a fraction of a byte; use whole-byte quantities" % name
            )
        granule = 1
        page = _HUGEPAGES.match(name)
        if page:
            granule = int(parse_quantity(page.group(1)))
        pages = int(total) // granule
        share, rest = divmod(pages, len(nodes))
        for index, node in enumerate(nodes):
            amount = (share + (rest if index == 0 else 0)) * granule
            if amount:
                per_node[node][name] = format_bytes(amount)
        if int(total) % granule:
            raise KubeletConfigError(
                "reserved %s (%s bytes) is not a whole number of pages" % (name, int(total))
            )
    return [{"numaNode": node, "limits": per_node[node]} for node in nodes if per_node[node]]


def render(plan, topology, settings, base_config=None):
    """The KubeletConfiguration fragment and the feature gates it needs.

    ``base_config`` is kubelet's main config file (None: the fragment is the whole file).
    Returns (config, warnings). Raises KubeletConfigError for settings that cannot be
    rendered at all; :func:`validate` checks the result.
    """
    version = parse_version(settings["kubelet_version"])
    warnings = []
    if version > NEWEST_KNOWN_VERSION:
        warnings.append(
            "kubelet %d.%d is newer than rtfleet's option table (%d.%d): option maturity and "
            "feature gates are assumed as of %d.%d" % (version + NEWEST_KNOWN_VERSION * 2)
        )
    table_version = min(version, NEWEST_KNOWN_VERSION)
    reserved = settings["reserved_system_cpus"]
    if reserved in (None, ""):
        reserved = plan["kubelet"]["reservedSystemCPUs"]
    config = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "cpuManagerPolicy": settings["cpu_manager_policy"],
        "reservedSystemCPUs": str(reserved),
        "cpuManagerReconcilePeriod": settings["cpu_manager_reconcile_period"],
        "topologyManagerPolicy": settings["topology_manager_policy"],
        "topologyManagerScope": settings["topology_manager_scope"],
        "memoryManagerPolicy": settings["memory_manager_policy"],
    }
    cpu_options = dict(settings["cpu_manager_policy_options"])
    if settings["recommended_cpu_options"]:
        for name in RECOMMENDED_CPU_OPTIONS:
            if option_stage(CPU_MANAGER_OPTIONS, name, table_version) not in ("beta", "ga"):
                continue
            clash = [
                b if a == name else a
                for a, b in CPU_OPTION_CONFLICTS
                if name in (a, b) and _truthy(cpu_options, b if a == name else a)
            ]
            if name not in cpu_options and not clash:
                cpu_options[name] = "true"
    if not _truthy(cpu_options, "strict-cpu-reservation"):
        strict = option_stage(CPU_MANAGER_OPTIONS, "strict-cpu-reservation", table_version)
        warnings.append(
            "strict-cpu-reservation is off (kubelet %d.%d%s): Burstable and BestEffort pods share "
            "the reserved CPUs, runtime CPUs included; only isolcpus keeps them off"
            % (*version, "" if strict in ("beta", "ga") else ", beta from 1.33")
        )
    if cpu_options:
        config["cpuManagerPolicyOptions"] = cpu_options
    topo_options = dict(settings["topology_manager_policy_options"])
    node_count = len(kubelet_numa_nodes(topology))
    if (
        node_count > DEFAULT_MAX_NUMA_NODES
        and settings["topology_manager_policy"] != "none"
        and "max-allowable-numa-nodes" not in topo_options
        and option_stage(TOPOLOGY_MANAGER_OPTIONS, "max-allowable-numa-nodes", table_version)
    ):
        topo_options["max-allowable-numa-nodes"] = str(node_count)
    if topo_options:
        config["topologyManagerPolicyOptions"] = topo_options
    for key, section in (
        ("kube_reserved", "kubeReserved"),
        ("system_reserved", "systemReserved"),
        ("eviction_hard", "evictionHard"),
    ):
        if settings[key]:
            config[section] = {k: str(v) for k, v in settings[key].items()}
    if settings["memory_manager_policy"] == "Static":
        if settings["reserved_memory"] == "auto":
            # What kubelet will load: the main file rtfleet rewrites, or its drop-in over it.
            view = merge(base_config or {}, merge(config, settings["extra"]))
            dropin = base_config is not None and config_target(version, settings["config_mode"])[0]
            base = base_config if dropin else None
            config["reservedMemory"] = _auto_reserved_memory(view, topology, version, base)
        else:
            config["reservedMemory"] = copy.deepcopy(settings["reserved_memory"])
    gates = {}
    for kind, options in (("cpu", cpu_options), ("topology", topo_options)):
        table = CPU_MANAGER_OPTIONS if kind == "cpu" else TOPOLOGY_MANAGER_OPTIONS
        stages = {option_stage(table, name, table_version) for name in options}
        stages.discard(None)
        if not stages:
            continue
        gate, gate_stages = _OPTIONS_GATE[kind]
        if option_stage({gate: gate_stages}, gate, table_version) != "ga":
            gates[gate] = True
        for level in ("alpha", "beta"):
            if level in stages:
                gates[_LEVEL_GATES[kind][level]] = True
    gates.update(settings["feature_gates"])
    if settings["feature_gates"] and known_feature_gates(version) is None:
        every = _GATES_1_31_TO_1_33 | _GATES_UNTIL_1_32 | _GATES_FROM_1_33 | _GATES_COMPONENT
        unknown = sorted(g for g in settings["feature_gates"] if g not in every)
        if unknown:
            warnings.append(
                "feature gates %s are not in rtfleet's gate table (kubelet %d.%d-%d.%d); kubelet "
                "%d.%d refuses to start on a name it does not know: check the spelling"
                % ((", ".join(unknown), *GATE_TABLE_VERSIONS[0], *GATE_TABLE_VERSIONS[1], *version))
            )
    if gates:
        config["featureGates"] = gates
    config = merge(config, settings["extra"])
    return config, warnings


# ------------------------------------------------------------------ validation


def _check_options(kind, options, version, *, gates, allow_alpha, errors):
    table = CPU_MANAGER_OPTIONS if kind == "cpu" else TOPOLOGY_MANAGER_OPTIONS
    label = "cpuManagerPolicyOptions" if kind == "cpu" else "topologyManagerPolicyOptions"
    role_key = "cpu_manager_policy_options" if kind == "cpu" else "topology_manager_policy_options"
    table_version = min(version, NEWEST_KNOWN_VERSION)
    for name, value in sorted(options.items()):
        stage = option_stage(table, name, table_version)
        if stage is None:
            first = min(table[name].values()) if name in table else None
            if first:
                errors.append(
                    "%s %s: kubelet %d.%d does not have this option (it appeared in %d.%d): "
                    "remove it from %s or upgrade kubelet"
                    % ((label, name, *version, *first, role_key))
                )
            else:
                errors.append(
                    "%s %s: unknown option (known: %s): fix the name in %s"
                    % (label, name, ", ".join(sorted(table)), role_key)
                )
            continue
        gate, gate_stages = _OPTIONS_GATE[kind]
        if (
            option_stage({gate: gate_stages}, gate, table_version) != "ga"
            and gates.get(gate) is False
        ):
            errors.append(
                "%s needs feature gate %s on kubelet %d.%d, but featureGates.%s is false: "
                "remove that override" % ((label, gate, *version, gate))
            )
        if stage in ("alpha", "beta"):
            level_gate = _LEVEL_GATES[kind][stage]
            if stage == "alpha" and not allow_alpha:
                errors.append(
                    "%s %s is alpha in kubelet %d.%d (needs feature gate %s): set "
                    "allow_alpha_options (rtfleet_kubelet_allow_alpha_options: true) to accept "
                    "an alpha option on this node, or remove it"
                    % ((label, name, *version, level_gate))
                )
            elif gates.get(level_gate) is False or (stage == "alpha" and not gates.get(level_gate)):
                errors.append(
                    "%s %s is %s in kubelet %d.%d and needs featureGates.%s: true; it is "
                    "disabled: remove the override or the option"
                    % ((label, name, stage, *version, level_gate))
                )
        if name == "max-allowable-numa-nodes":
            if not re.match(r"^[+-]?\d+$", value):
                errors.append(
                    "%s max-allowable-numa-nodes=%r is not an integer: give the number of NUMA "
                    "nodes the host has" % (label, value)
                )
            elif int(value) < DEFAULT_MAX_NUMA_NODES:
                errors.append(
                    '%s max-allowable-numa-nodes=%s: kubelet wants at least %d ("the minimum value '
                    'should not be less than 8"): raise it or drop the option'
                    % (label, value, DEFAULT_MAX_NUMA_NODES)
                )
        elif value not in _GO_BOOLS:
            errors.append(
                '%s %s=%r: kubelet parses this as a boolean: use "true" or "false"'
                % (label, name, value)
            )


def _truthy(options, name):
    return options.get(name) in ("1", "t", "T", "TRUE", "true", "True")


def validate(config, topology, settings, plan=None, base_config=None):
    """Errors (strings, each saying what to change) for the effective kubelet config.

    ``base_config`` is kubelet's main config file when ``config`` is a drop-in merged over it
    (None: ``config`` is the main file).
    """
    errors = []
    version = parse_version(settings["kubelet_version"])
    if version < MIN_VERSION:
        errors.append(
            "kubelet %d.%d is older than rtfleet supports (%d.%d: Topology Manager GA): upgrade "
            "kubelet or set rtfleet_kubelet_version to the version the node runs"
            % (version + MIN_VERSION)
        )
        return errors
    gates = config.get("featureGates") or {}
    for gate, value in gates.items():
        if not isinstance(value, bool):
            errors.append(
                "featureGates.%s must be true or false, got %r: fix rtfleet_kubelet_feature_gates"
                % (gate, value)
            )
    _check_feature_gates(gates, version, errors)
    allow_alpha = settings["allow_alpha_options"]
    online = set(topology.get("cpus") or [])
    nodes = kubelet_numa_nodes(topology)
    node_ids = {n["id"] for n in nodes} or {0}

    cpu_policy = config.get("cpuManagerPolicy", "none")
    if cpu_policy not in CPU_POLICIES:
        errors.append(
            'cpuManagerPolicy %r is not a kubelet CPU Manager policy (none, static): use "static"'
            % (cpu_policy,)
        )
    elif cpu_policy != "static":
        errors.append(
            "cpuManagerPolicy is %r: rtfleet needs static so the pod pool gets exclusive CPUs "
            "and runtime CPUs stay reserved; remove the override" % cpu_policy
        )

    reserved_text = str(config.get("reservedSystemCPUs", ""))
    reserved = None
    try:
        reserved = set(parse_cpuset(reserved_text))
    except ValueError as exc:
        errors.append(
            "invalid configuration: unable to parse reservedSystemCPUs %r (%s): "
            'write it like "0-1,64-65"' % (reserved_text, exc)
        )
    if reserved is not None:
        if not reserved:
            errors.append(
                "reservedSystemCPUs is empty: the static CPU Manager needs a non-zero reservation "
                "(the plan's housekeeping and runtime CPUs)"
            )
        missing = sorted(reserved - online) if online else []
        if missing:
            errors.append(
                "reservedSystemCPUs names CPUs %s that this host does not have online (%s): "
                "re-plan from this host's topology"
                % (format_cpuset(missing), format_cpuset(online))
            )
        if plan is not None:
            runtime = set(plan.get("runtime") or [])
            housekeeping = set(plan.get("housekeeping") or [])
            unreserved_runtime = sorted(runtime - reserved)
            if unreserved_runtime:
                errors.append(
                    "reservedSystemCPUs leaves runtime CPUs %s to the pod pool: kubelet would hand "
                    "pinned runtime CPUs to pods; reserve housekeeping + runtime (%s)"
                    % (format_cpuset(unreserved_runtime), plan["kubelet"]["reservedSystemCPUs"])
                )
            unreserved_hk = sorted(housekeeping - reserved)
            if unreserved_hk:
                errors.append(
                    "reservedSystemCPUs leaves housekeeping CPUs %s to pods: reserve them too (%s)"
                    % (format_cpuset(unreserved_hk), plan["kubelet"]["reservedSystemCPUs"])
                )
    if reserved_text and (config.get("systemReservedCgroup") or config.get("kubeReservedCgroup")):
        errors.append(
            "invalid configuration: can't use reservedSystemCPUs with systemReservedCgroup or "
            "kubeReservedCgroup: remove those cgroup settings (extra) or the reservation"
        )
    for section in ("kubeReserved", "systemReserved"):
        if "cpu" in (config.get(section) or {}) and reserved_text:
            errors.append(
                "%s.cpu is set, but reservedSystemCPUs already reserves exact CPUs and kubelet "
                "ignores the cpu amount: drop cpu from %s"
                % (section, "kube_reserved" if section == "kubeReserved" else "system_reserved")
            )

    cpu_options = config.get("cpuManagerPolicyOptions") or {}
    _check_options("cpu", cpu_options, version, gates=gates, allow_alpha=allow_alpha, errors=errors)
    for first, second in CPU_OPTION_CONFLICTS:
        if _truthy(cpu_options, first) and _truthy(cpu_options, second):
            errors.append(
                "static policy options %s and %s can not be used at the same time (kubelet "
                "refuses to start): keep one" % (first, second)
            )
    if _truthy(cpu_options, "full-pcpus-only") and reserved:
        split = []
        for core in topology.get("cores", []):
            cpus = set(core["cpus"])
            if cpus & reserved and not cpus <= reserved:
                split.append(format_cpuset(cpus))
        if split:
            errors.append(
                "full-pcpus-only is on, but reservedSystemCPUs splits SMT cores %s: reserve "
                "whole cores (both siblings) or turn full-pcpus-only off" % ", ".join(split)
            )
    if _truthy(cpu_options, "align-by-socket"):
        if config.get("topologyManagerPolicy") == "single-numa-node":
            errors.append(
                "align-by-socket is incompatible with topologyManagerPolicy single-numa-node: "
                "use restricted or best-effort, or drop the option"
            )
        sockets = len(topology.get("packages") or []) or 1
        cpu_nodes = _numa_nodes(topology)
        if sockets > len(cpu_nodes or [0]):
            errors.append(
                "align-by-socket needs at least as many NUMA nodes as sockets (this host has %d "
                "sockets, %d NUMA nodes): drop the option" % (sockets, len(cpu_nodes or [0]))
            )

    duration = config.get("cpuManagerReconcilePeriod")
    if duration is not None:
        try:
            if parse_duration(duration) <= 0:
                errors.append('cpuManagerReconcilePeriod must be greater than zero: use e.g. "10s"')
        except ValueError:
            errors.append(
                'cpuManagerReconcilePeriod %r is not a duration: write it like "10s" or "1m30s"'
                % (duration,)
            )

    topo_policy = config.get("topologyManagerPolicy", "none")
    if topo_policy not in TOPOLOGY_POLICIES:
        errors.append(
            "invalid configuration: topologyManagerPolicy %r must be one of: %s"
            % (topo_policy, ", ".join(TOPOLOGY_POLICIES))
        )
    scope = config.get("topologyManagerScope", "container")
    if scope not in TOPOLOGY_SCOPES:
        errors.append(
            "invalid configuration: topologyManagerScope %r must be one of: container, or pod"
            % (scope,)
        )
    topo_options = config.get("topologyManagerPolicyOptions") or {}
    _check_options(
        "topology", topo_options, version, gates=gates, allow_alpha=allow_alpha, errors=errors
    )
    if len(nodes) > DEFAULT_MAX_NUMA_NODES and topo_policy != "none":
        without_cpus = [n["id"] for n in nodes if not n.get("cpus")]
        cpuless = (
            " (CPU-less %s included: the Topology Manager counts every node)"
            % format_cpuset(without_cpus)
            if without_cpus
            else ""
        )
        limit = topo_options.get("max-allowable-numa-nodes", "")
        allowed = int(limit) if re.match(r"^\d+$", limit) else DEFAULT_MAX_NUMA_NODES
        if allowed < len(nodes):
            if option_stage(
                TOPOLOGY_MANAGER_OPTIONS,
                "max-allowable-numa-nodes",
                min(version, NEWEST_KNOWN_VERSION),
            ):
                errors.append(
                    "this host has %d NUMA nodes%s and the Topology Manager refuses more than "
                    "%d: set topology_manager_policy_options max-allowable-numa-nodes to %d or "
                    "more" % (len(nodes), cpuless, allowed, len(nodes))
                )
            else:
                errors.append(
                    "this host has %d NUMA nodes%s; kubelet %d.%d's Topology Manager refuses "
                    "more than 8 (max-allowable-numa-nodes came in 1.31): upgrade kubelet, set "
                    "topology_manager_policy none, or fold nodes in the BIOS (NPS1)"
                    % ((len(nodes), cpuless, *version))
                )

    errors.extend(_validate_memory(config, topology, node_ids, version, base_config))
    return errors


def _validate_memory(config, topology, node_ids, version, base=None):
    errors = []
    policy = config.get("memoryManagerPolicy", "None")
    if policy not in MEMORY_POLICIES:
        errors.append(
            "memoryManagerPolicy %r is not a Memory Manager policy (None, Static): note the "
            "capital letter" % (policy,)
        )
        return errors
    reservations = config.get("reservedMemory") or []
    seen = set()
    per_type = {}
    per_node_bytes = {}
    for index, entry in enumerate(reservations):
        if not isinstance(entry, dict) or "numaNode" not in entry:
            errors.append(
                "reservedMemory[%d] must be {numaNode: N, limits: {memory: 1Gi}}, got %r"
                % (index, entry)
            )
            continue
        node = entry["numaNode"]
        if isinstance(node, bool) or not isinstance(node, int):
            errors.append("reservedMemory[%d].numaNode must be an integer, got %r" % (index, node))
            continue
        if node not in node_ids:
            errors.append(
                "the reserved memory configuration references a NUMA node %d that does not exist "
                "on this machine (nodes %s): fix reservedMemory" % (node, format_cpuset(node_ids))
            )
        for name, value in sorted((entry.get("limits") or {}).items()):
            if name != "memory" and not _HUGEPAGES.match(name):
                errors.append(
                    "invalid configuration: the limit type %r for NUMA node %d is not supported, "
                    "only memory and hugepages-<size> are accepted" % (name, node)
                )
                continue
            try:
                amount = parse_quantity(value)
            except ValueError:
                errors.append(
                    "reservedMemory NUMA node %d %s: %r is not a quantity (write 1Gi, 512Mi)"
                    % (node, name, value)
                )
                continue
            if amount == 0:
                errors.append(
                    "invalid configuration: reserved memory may not be zero for NUMA node %d and "
                    "resource %r: remove the entry or give an amount" % (node, name)
                )
            if (node, name) in seen:
                errors.append(
                    "invalid configuration: the reserved memory has a duplicate value for NUMA "
                    "node %d and resource %r: keep one" % (node, name)
                )
            seen.add((node, name))
            per_type[name] = per_type.get(name, Fraction(0)) + amount
            if name == "memory":
                per_node_bytes[node] = per_node_bytes.get(node, Fraction(0)) + amount
    if policy != "Static":
        return errors
    eviction = _eviction_memory(config, version, base)
    if _is_percentage(eviction):
        errors.append(
            "evictionHard memory.available is %s (a percentage); the Static Memory Manager needs "
            "reservedMemory to equal kubeReserved + systemReserved + evictionHard exactly: give "
            "an absolute quantity" % str(eviction).strip()
        )
        return errors
    try:
        expected = _memory_reservation_total(config, version, base)
    except ValueError as exc:
        errors.append("kubeReserved/systemReserved/evictionHard: %s" % exc)
        return errors
    if not expected.get("memory"):
        errors.append(
            "memoryManagerPolicy Static needs a memory reservation (kubeReserved + systemReserved "
            "+ evictionHard memory): set rtfleet_kubelet_kube_reserved/system_reserved memory"
        )
    for name in sorted(set(expected) | set(per_type)):
        want = expected.get(name, Fraction(0))
        have = per_type.get(name, Fraction(0))
        if want != have:
            errors.append(
                "reservedMemory %s adds up to %s over the NUMA nodes, but kubeReserved + "
                "systemReserved + evictionHard for %s is %s; kubelet's Static Memory Manager "
                "refuses to start unless they are equal: fix reservedMemory or use "
                'reserved_memory: "auto"' % (name, format_bytes(have), name, format_bytes(want))
            )
    capacity = {n["id"]: n.get("memory_kb") for n in kubelet_numa_nodes(topology)}
    for node, amount in sorted(per_node_bytes.items()):
        memory_kb = capacity.get(node)
        if memory_kb == 0:
            errors.append(
                "reservedMemory reserves %s on NUMA node %d, which has no memory (memoryless): "
                "move it to a node with memory" % (format_bytes(amount), node)
            )
        elif memory_kb and amount > memory_kb * 1024:
            errors.append(
                "reservedMemory reserves %s on NUMA node %d, which has only %s: lower it"
                % (format_bytes(amount), node, format_bytes(memory_kb * 1024))
            )
    return errors


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


# ------------------------------------------------------------------ files


def dump(config, header):
    """File content: the managed header as comments, then the config as indented JSON.

    JSON is YAML, so kubelet reads it as its config file; unlike YAML it cannot turn an
    option value "true" into a boolean that kubelet's map[string]string refuses.
    """
    lines = ["# " + line if line else "#" for line in header.splitlines()]
    return "\n".join(lines) + "\n" + json.dumps(config, indent=2, sort_keys=True) + "\n"


def load(text):
    """Parse a file written by :func:`dump` (comment lines, then JSON); ValueError if not."""
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    data = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError("not a mapping")
    return data


def build(
    plan,
    topology,
    settings,
    *,
    base_config=None,
    previous_text=None,
    cpu_state=None,
    memory_state=None,
):
    """Render, validate and decide. Raises KubeletConfigError listing every problem.

    ``base_config`` is kubelet's main config file as parsed (None or {} when absent);
    ``previous_text`` the current content of the file rtfleet writes (None when absent).
    """
    settings = normalize_settings(settings)
    version = parse_version(settings["kubelet_version"])
    use_dropin, warnings = config_target(version, settings["config_mode"])
    base = base_config or {}
    fragment, render_warnings = render(plan, topology, settings, base_config=base)
    warnings += render_warnings
    effective = merge(base, fragment)
    errors = validate(effective, topology, settings, plan, base_config=base if use_dropin else None)
    if errors:
        raise KubeletConfigError(
            "kubelet configuration refused (%d problem%s), nothing was changed:\n- %s"
            % (len(errors), "" if len(errors) == 1 else "s", "\n- ".join(errors))
        )
    if not plan.get("pod_pool"):
        warnings.append(
            "the plan leaves no pod-pool CPUs: every CPU is reserved, so Guaranteed pods get no "
            "exclusive CPUs (set runtime_l3_groups to a count to leave some to pods)"
        )
    previous = None
    if use_dropin:
        if previous_text is None:
            previous = base
        else:
            try:
                previous = merge(base, load(previous_text))
            except ValueError:
                warnings.append(
                    "the current drop-in is not one rtfleet wrote; treating the previous "
                    "configuration as unknown"
                )
        written = fragment
    else:
        previous = base if base else None
        written = effective
    return {
        "version": "%d.%d" % version,
        "dropin": use_dropin,
        "config": written,
        "effective": effective,
        "previous": previous,
        "state": state_reset(previous, effective, cpu_state, memory_state),
        "warnings": warnings,
    }
