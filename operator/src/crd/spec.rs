//! `InferenceService` spec: what the user asks for. Bounds and enums here become the CRD's
//! OpenAPI schema, so the API server rejects nonsense (422) before the operator sees it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    EmptyDirVolumeSource, EnvVar, HostPathVolumeSource, PersistentVolumeClaimVolumeSource,
    ResourceRequirements, Toleration,
};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::status::InferenceServiceStatus;

/// A model served by prefill and decode worker pools behind a router.
#[derive(CustomResource, Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[kube(
    group = "serving.cleave.dev",
    version = "v1alpha1",
    kind = "InferenceService",
    plural = "inferenceservices",
    singular = "inferenceservice",
    shortname = "isvc",
    shortname = "cisvc",
    namespaced,
    status = "InferenceServiceStatus",
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Prefill","type":"string","jsonPath":".status.prefill.summary"}"#,
    printcolumn = r#"{"name":"Decode","type":"string","jsonPath":".status.decode.summary"}"#,
    printcolumn = r#"{"name":"Router","type":"string","jsonPath":".status.router.summary"}"#,
    printcolumn = r#"{"name":"Endpoint","type":"string","jsonPath":".status.routerEndpoint","priority":1}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct InferenceServiceSpec {
    /// The model to serve and where its weights come from.
    pub model: ModelSpec,
    /// Container image holding the cleave binaries (cleave-prefill, cleave-decode,
    /// cleave-router); default: the operator's `--default-image`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub image: Option<String>,
    /// Prefill worker pool (replicas 0 disables disaggregation: decode workers prefill locally).
    #[serde(default)]
    pub prefill: PoolSpec,
    /// Decode worker pool.
    #[serde(default)]
    pub decode: PoolSpec,
    /// The OpenAI-compatible router in front of the pools.
    #[serde(default)]
    pub router: RouterSpec,
    /// How KV moves from prefill to decode workers.
    #[serde(default)]
    pub kv_transfer: KvTransferSpec,
    /// Queue-depth autoscaling policy for pools that set `autoscaling` bounds.
    #[serde(default)]
    pub autoscaling: AutoscalingSpec,
    /// Gateway API Inference Extension integration: an InferencePool and an endpoint picker.
    #[serde(default)]
    pub gateway: super::GatewaySpec,
    /// Mutual TLS between the router and the workers and between workers (their gRPC and the
    /// KV transport's TCP path); unset: plain inside the cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub internal_tls: Option<InternalTlsSpec>,
}

/// Where the internal mutual-TLS identity comes from.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InternalTlsSpec {
    /// A Secret in cert-manager's layout (`tls.crt`, `tls.key`, `ca.crt`; a cert-manager
    /// Certificate's `secretName`). Every router and worker pod presents its certificate and
    /// requires one issued by its CA from each peer.
    #[schemars(length(min = 1, max = 253))]
    pub secret_name: String,
    /// The DNS name in the certificate that peers are checked against (one certificate for the
    /// whole service); unset: the pod IP dialled, which the certificate must then carry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub server_name: Option<String>,
}

/// The model and its source.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ModelSpec {
    /// Model name clients send (default: the GGUF file name without `.gguf`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub served_name: Option<String>,
    /// The chat template the router serves `/v1/chat/completions` with, instead of the one in
    /// the model file (for a model that ships without one, or to replace it): a built-in name
    /// (`chatml`, `llama3`, `gemma`) or the Jinja template text itself. A template that does not
    /// compile stops the router with an error naming it (the `ContainerFailing` condition).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 131072))]
    pub chat_template: Option<String>,
    /// The element type of both pools' KV caches (`--kv-dtype`; unset: the workers' default,
    /// f16). `q8_0` stores 8.5 bits per element, as llama.cpp's `-ctk q8_0 -ctv q8_0`, and needs
    /// a head size that is a multiple of 32 (a worker refuses the model otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_dtype: Option<KvCacheDtype>,
    /// Weights file format (the engine reads GGUF).
    #[serde(default)]
    pub format: ModelFormat,
    /// Where the weights come from: exactly one of `path`, `url`, `image`.
    pub source: ModelSource,
}

/// Weights file format.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ModelFormat {
    /// A GGUF file.
    #[default]
    Gguf,
}

/// Where the weights come from (exactly one field set).
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct ModelSource {
    /// A file on a PersistentVolumeClaim, or on the node (hostPath) when no claim is named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathSource>,
    /// An HTTP(S) URL, downloaded by an init container into an emptyDir.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<UrlSource>,
    /// An OCI image that contains the file; an init container copies it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageSource>,
}

/// A model file on a volume.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PathSource {
    /// PersistentVolumeClaim holding the file (mounted read-only); unset: a node path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub claim_name: Option<String>,
    /// Path of the file: inside the claim (relative), or absolute on the node.
    #[schemars(length(min = 1, max = 4096))]
    pub path: String,
}

/// A model file to download.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct UrlSource {
    /// http:// or https:// URL of the GGUF file.
    #[schemars(regex(pattern = r"^https?://[^\s]+$"), length(max = 4096))]
    pub url: String,
    /// Expected sha256 (hex); the download fails when it differs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub sha256: Option<String>,
}

/// A model file inside an image.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ImageSource {
    /// The image (needs a `cp` binary).
    #[schemars(length(min = 1, max = 512))]
    pub image: String,
    /// Absolute path of the GGUF file inside the image.
    #[schemars(regex(pattern = r"^/.+"), length(max = 4096))]
    pub path: String,
}

/// One worker pool.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PoolSpec {
    /// Fixed number of worker groups (each group is `parallelism.nodesPerGroup` pods); mutually
    /// exclusive with `autoscaling`. Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1000))]
    pub replicas: Option<i32>,
    /// Autoscale this pool on queue depth between these bounds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<PoolAutoscaling>,
    /// Container resources of each worker pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// How one model instance is split across devices and nodes.
    #[serde(default)]
    pub parallelism: Parallelism,
    /// Engine compute threads per worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1024))]
    pub threads: Option<u32>,
    /// KV blocks per worker (16 tokens each); overrides `kvMemory`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16777216))]
    pub kv_blocks: Option<u32>,
    /// The KV pool's size when `kvBlocks` is not given: `auto` (the workers' default: one
    /// sequence of the model's whole context, up to 32,768 tokens) or the bytes of the whole
    /// model's KV, e.g. `4Gi`, `512MiB`, `8G` (a group's ranks each hold their heads' share).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(r"^(auto|[0-9]+(\.[0-9]+)? *([KkMmGgTtPpEe][Ii]?[Bb]?|[Bb])?)$"))]
    pub kv_memory: Option<String>,
    /// KV tiers below each worker's pool: host memory and a disk directory (docs/kv-tiers.md).
    /// Not yet for worker groups (`parallelism` above 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache: Option<KvCacheSpec>,
    /// Pod template overrides.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Pod tolerations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Extra environment variables of the worker container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
}

/// The KV tiers of a pool's workers.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct KvCacheSpec {
    /// Host-memory tier per worker, e.g. `8Gi`: blocks the pool evicts are kept there and
    /// copied back on a prefix hit. Count it in the pod's memory limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(r"^[0-9]+(\.[0-9]+)? *([KkMmGgTtPpEe][Ii]?[Bb]?|[Bb])?$"))]
    pub host_memory: Option<String>,
    /// Disk tier per worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<KvDiskSpec>,
}

/// A pool's disk KV tier.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct KvDiskSpec {
    /// Bytes each worker's disk tier may hold, e.g. `100Gi`.
    #[schemars(pattern(r"^[0-9]+(\.[0-9]+)? *([KkMmGgTtPpEe][Ii]?[Bb]?|[Bb])?$"))]
    pub size: String,
    /// Demotions plus restores a block needs before it is written (the workers' default: 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub min_uses: Option<u32>,
    /// Where the entries live (exactly one): `emptyDir` (lost with the pod), `hostPath` (kept
    /// on the node: a replacement pod, e.g. in a rolling update, finds its predecessor's
    /// entries; the pods of a node share it, each claiming a slot) or `persistentVolumeClaim`.
    pub volume: KvDiskVolume,
}

/// The volume of a disk KV tier.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct KvDiskVolume {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub empty_dir: Option<EmptyDirVolumeSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<HostPathVolumeSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<PersistentVolumeClaimVolumeSource>,
}

/// Autoscaling bounds of one pool (in worker groups).
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PoolAutoscaling {
    /// Fewest groups.
    #[schemars(range(min = 0, max = 1000))]
    pub min_replicas: i32,
    /// Most groups (must be >= minReplicas; checked by the operator).
    #[schemars(range(min = 1, max = 1000))]
    pub max_replicas: i32,
}

/// Parallelism of one model instance.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Parallelism {
    /// Tensor-parallel degree.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 64))]
    pub tensor: u32,
    /// Expert-parallel degree (MoE models).
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 64))]
    pub expert: u32,
    /// Pods (nodes) per group; >1 makes a multi-node group (LeaderWorkerSet or StatefulSet).
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 64))]
    pub nodes_per_group: u32,
}

fn one() -> u32 {
    1
}

impl Default for Parallelism {
    fn default() -> Self {
        Self {
            tensor: 1,
            expert: 1,
            nodes_per_group: 1,
        }
    }
}

/// The router.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RouterSpec {
    /// Router pods.
    #[serde(default = "one_i32")]
    #[schemars(range(min = 0, max = 100))]
    pub replicas: i32,
    /// Placement policy.
    #[serde(default)]
    pub policy: Policy,
    /// Secret with accepted API keys (one per line) under `key`; unset: no auth.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_secret: Option<SecretKeyRef>,
    /// Requests running at once per router.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100000))]
    pub max_in_flight: Option<u32>,
    /// Requests waiting per router before 429.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1000000))]
    pub max_queue: Option<u32>,
    /// Longest a request waits for a slot before a 429, seconds (the admission SLO; the
    /// router refuses at once a request whose queue would not drain in time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3600))]
    pub queue_timeout_seconds: Option<u32>,
    /// Service type of the router Service.
    #[serde(default)]
    pub service_type: ServiceType,
    /// Router container resources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
}

fn one_i32() -> i32 {
    1
}

impl Default for RouterSpec {
    fn default() -> Self {
        Self {
            replicas: 1,
            policy: Policy::default(),
            api_key_secret: None,
            max_in_flight: None,
            max_queue: None,
            queue_timeout_seconds: None,
            service_type: ServiceType::default(),
            resources: None,
        }
    }
}

/// The router's placement policy (the router's `--policy`).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// `prefix-load` plus the router's own placements whose KV events have not arrived yet
    /// (the router's default; docs/routing.md).
    #[default]
    PrefixOptimistic,
    /// Prefix-cache affinity weighed against load.
    PrefixLoad,
    /// Workers in turn.
    RoundRobin,
    /// Least loaded worker.
    LeastLoad,
    /// Random healthy worker.
    Random,
}

impl Policy {
    /// The router's `--policy` value (the same kebab-case name the CRD uses).
    pub fn as_flag(self) -> &'static str {
        match self {
            Policy::PrefixOptimistic => "prefix-optimistic",
            Policy::PrefixLoad => "prefix-load",
            Policy::RoundRobin => "round-robin",
            Policy::LeastLoad => "least-load",
            Policy::Random => "random",
        }
    }
}

/// A key in a Secret.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Secret name (same namespace).
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Key within the Secret (default `keys`).
    #[serde(default = "default_key")]
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

fn default_key() -> String {
    "keys".into()
}

/// Router Service type.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
pub enum ServiceType {
    /// Cluster-internal.
    #[default]
    ClusterIP,
    /// A port on every node.
    NodePort,
    /// An external load balancer.
    LoadBalancer,
}

/// KV transfer between prefill and decode workers.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct KvTransferSpec {
    /// Transport (the workers' `--transport`).
    #[serde(default)]
    pub backend: KvBackend,
    /// UCX settings (used by the ucx backend, and by auto when UCX is available).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ucx: Option<UcxSpec>,
}

/// The element type of stored keys and values.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
pub enum KvCacheDtype {
    /// 4 bytes per element.
    #[serde(rename = "f32")]
    F32,
    /// 2 bytes per element.
    #[serde(rename = "f16")]
    F16,
    /// Blocks of 32 elements in 34 bytes.
    #[serde(rename = "q8_0")]
    Q8_0,
}

impl KvCacheDtype {
    /// The workers' flag value.
    pub fn as_flag(self) -> &'static str {
        match self {
            KvCacheDtype::F32 => "f32",
            KvCacheDtype::F16 => "f16",
            KvCacheDtype::Q8_0 => "q8_0",
        }
    }
}

/// KV transport.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum KvBackend {
    /// UCX when available, else TCP.
    #[default]
    Auto,
    /// UCX (RDMA, shared memory, TCP inside UCX).
    Ucx,
    /// Plain TCP.
    Tcp,
}

/// UCX environment for the workers.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct UcxSpec {
    /// `UCX_TLS`, e.g. `rc,sm,self` or `tcp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[a-z_,^]+$"))]
    pub transports: Option<String>,
    /// `UCX_NET_DEVICES`, e.g. `mlx5_0:1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub net_devices: Option<String>,
    /// RDMA device resource to request per worker (e.g. `rdma/hca: 1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub rdma_resource: Option<String>,
}

/// Queue-depth autoscaling policy.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingSpec {
    /// Target requests queued per worker group; desired = ceil(total queued / target).
    #[serde(default = "default_target")]
    #[schemars(range(min = 1, max = 10000))]
    pub target_queue_depth: u32,
    /// Scale up to the lowest recommendation seen in this window (0: at once).
    #[serde(default)]
    #[schemars(range(min = 0, max = 3600))]
    pub scale_up_stabilization_seconds: u32,
    /// Scale down to the highest recommendation seen in this window.
    #[serde(default = "default_down_window")]
    #[schemars(range(min = 0, max = 3600))]
    pub scale_down_stabilization_seconds: u32,
    /// Most groups added in one step.
    #[serde(default = "default_step")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_scale_up_step: u32,
    /// Most groups removed in one step.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_scale_down_step: u32,
    /// How often metrics are read and a decision made.
    #[serde(default = "default_period")]
    #[schemars(range(min = 5, max = 3600))]
    pub period_seconds: u32,
}

fn default_target() -> u32 {
    4
}
fn default_down_window() -> u32 {
    300
}
fn default_step() -> u32 {
    4
}
fn default_period() -> u32 {
    15
}

impl Default for AutoscalingSpec {
    fn default() -> Self {
        Self {
            target_queue_depth: default_target(),
            scale_up_stabilization_seconds: 0,
            scale_down_stabilization_seconds: default_down_window(),
            max_scale_up_step: default_step(),
            max_scale_down_step: 1,
            period_seconds: default_period(),
        }
    }
}
