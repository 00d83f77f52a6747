"""What kubelet knows, per minor version: option maturity, feature gates, policies, limits.

Kubelet's own tables, copied from its sources: CPU and Topology Manager policy options with
the version each reached alpha, beta and GA (pkg/kubelet/cm/cpumanager/policy_options.go,
pkg/kubelet/cm/topologymanager/policy_options.go and the release notes), the feature gates
it registers and those locked to their default, the policy names it accepts, and when it
began reading a drop-in directory. Versions newer than the table are treated as the newest
version it knows. Data and small lookups only: stdlib-only, Python 3.9-compatible.
"""

from __future__ import annotations

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
OPTION_TABLES = {"cpu": CPU_MANAGER_OPTIONS, "topology": TOPOLOGY_MANAGER_OPTIONS}
# The feature gate that must be on for any option at all, while it is not GA.
_OPTIONS_GATE = {
    "cpu": ("CPUManagerPolicyOptions", {"alpha": (1, 22), "beta": (1, 23), "ga": (1, 33)}),
    "topology": (
        "TopologyManagerPolicyOptions",
        {"alpha": (1, 26), "beta": (1, 28), "ga": (1, 32)},
    ),
}
LEVEL_GATES = {
    "cpu": {"alpha": "CPUManagerPolicyAlphaOptions", "beta": "CPUManagerPolicyBetaOptions"},
    "topology": {
        "alpha": "TopologyManagerPolicyAlphaOptions",
        "beta": "TopologyManagerPolicyBetaOptions",
    },
}
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
# Every name some version in the table registers.
TABLED_FEATURE_GATES = _GATES_1_31_TO_1_33 | _GATES_UNTIL_1_32 | _GATES_FROM_1_33 | _GATES_COMPONENT
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


# ------------------------------------------------------------------ option maturity


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


def options_gate(kind, version):
    """The gate kubelet ``version`` needs on for any ``kind`` option, None once it is GA."""
    gate, gate_stages = _OPTIONS_GATE[kind]
    if option_stage({gate: gate_stages}, gate, version) != "ga":
        return gate
    return None
