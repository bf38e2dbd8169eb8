//! One shape for every failure that carries a stable reason code. [`Reason`] is the one
//! type of every code the agent reports (the agent's catalogue gives each its source,
//! meaning and exit class with an exhaustive `match`, so a variant without an entry does not
//! compile). Every error type of the boundaries and decisions implements [`ReasonCode`]; the
//! agent turns any of them into a stage failure with one blanket conversion, so a code is
//! never copied by hand and a new error type cannot reach a stage without one.

/// Declares [`Reason`] from one list of variants: the enum, its list and its spelling.
macro_rules! reasons {
    ($($v:ident,)*) => {
        /// Every stable reason code the agent reports: in the log, the Node condition, the
        /// Event, the `taintgate_failures_total{reason}` metric, the timeline and the exit
        /// code. Written and read as the variant's name (`GpuCountMismatch`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[allow(missing_docs)] // each variant is documented in the agent's catalogue
        pub enum Reason {
            $($v,)*
        }

        impl Reason {
            /// Every variant, in catalogue order.
            pub const ALL: &'static [Reason] = &[$(Reason::$v,)*];

            /// The code as written everywhere (the variant's name).
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Reason::$v => stringify!($v),)*
                }
            }
        }
    };
}

reasons! {
    Released,
    WouldRelease,
    AlreadyReleased,
    HardwareVerified,
    DependencyFailed,
    DeadlineExceeded,
    Cancelled,
    InternalError,
    InvalidInput,
    KubeconfigInvalid,
    NoCluster,
    NodeNotRegistered,
    NodeNotFound,
    ApiUnavailable,
    ApiForbidden,
    ApiConflict,
    ApiInvalid,
    ApiError,
    DryRun,
    UntaintFailed,
    RegateFailed,
    DriverNotLoaded,
    NvmlError,
    GpuLost,
    GpuCountMismatch,
    GpuProductMismatch,
    EccUncorrectable,
    RowRemapPending,
    RowRemapFailed,
    PagesRetired,
    XidFatal,
    GpuRecoveryRequired,
    SxidFatal,
    NvmlFieldUnreadable,
    XidWarning,
    FabricNotReady,
    FabricMismatch,
    FabricDegraded,
    ImexChannelsMissing,
    NetworkUnreadable,
    RdmaPortsMissing,
    RdmaLinkLayerMismatch,
    RdmaPortDown,
    RdmaRateLow,
    RdmaDevicesMissing,
    RdmaLinkFlapping,
    GpuDirectUnavailable,
    NicAffinityBroken,
    NvlinkInactive,
    PcieDegraded,
    PersistenceModeOff,
    SmokeFailed,
    PeerBandwidthLow,
    PeerNotDirect,
    PeerBandwidthUnknown,
    PeerBandwidthFailed,
    NcclMissing,
    GpuCountUnconfigured,
    CudaWorkerCrashed,
    CudaWorkerTimeout,
    PeerCopyMismatch,
    XidWatchError,
    AllocatableZero,
    AllocatableShort,
    AllocatableExcess,
    LabelMismatch,
    PluginConfigMismatch,
    PluginSocketMissing,
    PluginUnreachable,
    PluginTimeout,
    PluginRpcFailed,
    PluginReplyInvalid,
    PluginDevicesMismatch,
    PluginDeviceUnhealthy,
    PodResourcesUnavailable,
    KubeletDevicesMismatch,
    DraSlicesMissing,
    DraPoolIncomplete,
    DraDevicesMismatch,
    DraDriverNotRegistered,
    GpuPublicationMissing,
    RuntimeInjectionMissing,
    GroupFitShort,
    ManifestInvalid,
    ManifestDigestMismatch,
    DigestMismatch,
    SizeMismatch,
    SourceNotFound,
    SourceForbidden,
    SourceChanged,
    SourceUnavailable,
    SourceUnsupported,
    DiskInsufficient,
    CacheIoError,
    OptionsInvalid,
    ImageNotPinned,
    ImageReferenceInvalid,
    ImagesConfigInvalid,
    ImageAuthConfigInvalid,
    ImageAuthFailed,
    ImagePullFailed,
    ImagePullTimeout,
    ImageDigestMismatch,
    RuntimeUnavailable,
    ImageRuntimeError,
    WorkloadReady,
    NoEndpointYet,
    NoWorkloadYet,
    WorkloadNotReady,
    ReadinessWatchFailed,
    AnnotationInvalid,
    OtlpConfigInvalid,
    OtlpExportFailed,
    OtlpExportTimeout,
    NodeReadFailed,
    NodeClaimReadFailed,
    MetricsBindFailed,
    MetricsEncodeFailed,
    NoTimeline,
    NoNodes,
    TimelineReadFailed,
    SvgWriteFailed,
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that is no reason code of this release.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown reason code {0:?}")]
pub struct UnknownReason(pub String);

impl std::str::FromStr for Reason {
    type Err = UnknownReason;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Reason::ALL
            .iter()
            .copied()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| UnknownReason(s.chars().take(64).collect()))
    }
}

impl serde::Serialize for Reason {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for Reason {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A failure with a stable reason code.
pub trait ReasonCode: std::fmt::Display {
    /// The stable reason code.
    fn reason(&self) -> Reason;
    /// Whether waiting or retrying may clear it (default: no).
    fn is_transient(&self) -> bool {
        false
    }
}

/// A decision that holds the node: its stable code, a message naming what was read, and
/// whether waiting may clear it. The one failure type of the pure decisions that need
/// nothing more (the fabric's, the network's).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Hold {
    /// Stable reason code.
    pub reason: Reason,
    /// Names the devices, GPUs and values read.
    pub message: String,
    /// Waiting may clear it (a link still training, a registration still running).
    pub transient: bool,
}

impl Hold {
    /// A hold that waiting does not clear.
    pub fn permanent(reason: Reason, message: String) -> Self {
        Self {
            reason,
            message,
            transient: false,
        }
    }

    /// A hold that waiting may clear.
    pub fn transient(reason: Reason, message: String) -> Self {
        Self {
            reason,
            message,
            transient: true,
        }
    }
}

impl ReasonCode for Hold {
    fn reason(&self) -> Reason {
        self.reason
    }
    fn is_transient(&self) -> bool {
        self.transient
    }
}
