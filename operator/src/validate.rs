//! Checks the CRD schema cannot express (the 1.20 API server has no CEL), reported in status.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::crd::{InferenceServiceSpec, PoolSpec};

/// The GPU resource name counted against parallelism.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// Findings: `errors` block reconciliation (Degraded/InvalidSpec); `notes` are facts the
/// operator cannot check and says so.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Findings {
    /// What is wrong.
    pub errors: Vec<String>,
    /// What could not be checked.
    pub notes: Vec<String>,
}

fn gpus(pool: &PoolSpec) -> Option<i64> {
    let r = pool.resources.as_ref()?;
    let q: &Quantity = r
        .limits
        .as_ref()
        .and_then(|l| l.get(GPU_RESOURCE))
        .or_else(|| r.requests.as_ref().and_then(|l| l.get(GPU_RESOURCE)))?;
    q.0.parse().ok()
}

fn check_pool(name: &str, pool: &PoolSpec, f: &mut Findings) {
    if pool.replicas.is_some() && pool.autoscaling.is_some() {
        f.errors.push(format!(
            "{name}: set either replicas or autoscaling, not both"
        ));
    }
    if let Some(a) = &pool.autoscaling {
        if a.min_replicas > a.max_replicas {
            f.errors.push(format!(
                "{name}.autoscaling: minReplicas {} > maxReplicas {}",
                a.min_replicas, a.max_replicas
            ));
        }
    }
    let p = &pool.parallelism;
    let ranks = p.tensor * p.expert;
    if !ranks.is_multiple_of(p.nodes_per_group) {
        f.errors.push(format!(
            "{name}.parallelism: tensor*expert = {ranks} is not divisible by nodesPerGroup {}",
            p.nodes_per_group
        ));
    } else if let Some(g) = gpus(pool) {
        let per_node = i64::from(ranks / p.nodes_per_group);
        if g != per_node {
            f.errors.push(format!(
                "{name}: tensor*expert/nodesPerGroup = {per_node} devices per pod, but resources ask for {g} {GPU_RESOURCE}"
            ));
        }
    }
    if let Some(g) = gpus(pool).filter(|g| *g > 0) {
        f.notes.push(format!(
            "{name}: asks for {g} {GPU_RESOURCE} per pod, but cleave's engine has no GPU kernels yet: the pods are scheduled on GPU nodes and compute on their CPUs"
        ));
    }
    if p.tensor > 1 {
        f.notes.push(format!(
            "{name}: tensor={} must divide the model's attention heads; the head count is in the weights, so this is checked by the worker when it loads them, not here",
            p.tensor
        ));
    }
    if let Some(kv) = &pool.kv_cache {
        if p.tensor * p.expert * p.nodes_per_group > 1 {
            f.errors.push(format!(
                "{name}.kvCache: KV tiers are not supported in worker groups yet (parallelism above 1)"
            ));
        }
        if let Some(d) = &kv.disk {
            let v = &d.volume;
            let sources = [
                v.empty_dir.is_some(),
                v.host_path.is_some(),
                v.persistent_volume_claim.is_some(),
            ];
            if sources.iter().filter(|s| **s).count() != 1 {
                f.errors.push(format!(
                    "{name}.kvCache.disk.volume: set exactly one of emptyDir, hostPath, persistentVolumeClaim"
                ));
            }
        }
    }
    if let Some(res) = &pool.resources {
        for (kind, map) in [("requests", &res.requests), ("limits", &res.limits)] {
            if let Some(map) = map {
                if let Some(q) = map.get(GPU_RESOURCE) {
                    if q.0.parse::<i64>().is_err() {
                        f.errors.push(format!(
                            "{name}.resources.{kind}[{GPU_RESOURCE}] = {:?} is not a whole number",
                            q.0
                        ));
                    }
                }
            }
        }
    }
}

/// Validates what the schema cannot.
pub fn validate(spec: &InferenceServiceSpec) -> Findings {
    let mut f = Findings::default();
    let s = &spec.model.source;
    let sources = [s.path.is_some(), s.url.is_some(), s.image.is_some()];
    if sources.iter().filter(|x| **x).count() != 1 {
        f.errors
            .push("model.source: set exactly one of path, url, image".into());
    }
    check_pool("prefill", &spec.prefill, &mut f);
    check_pool("decode", &spec.decode, &mut f);
    if spec.decode.replicas == Some(0)
        && spec
            .decode
            .autoscaling
            .as_ref()
            .is_none_or(|a| a.max_replicas == 0)
    {
        f.errors
            .push("decode: at least one decode group is needed to serve requests".into());
    }
    if spec.gateway.inference_pool && spec.decode.parallelism.nodes_per_group > 1 {
        f.errors.push(
            "gateway.inferencePool: the pool's endpoints must each serve a whole model; \
             multi-node decode groups (decode.parallelism.nodesPerGroup > 1) are not supported \
             behind a Gateway yet"
                .into(),
        );
    }
    f
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::core::v1::ResourceRequirements;

    use super::*;
    use crate::crd::{Parallelism, PathSource, PoolAutoscaling};

    fn spec() -> InferenceServiceSpec {
        let mut s = InferenceServiceSpec::default();
        s.model.source.path = Some(PathSource {
            claim_name: None,
            path: "/m/x.gguf".into(),
        });
        s
    }

    #[test]
    fn a_kv_cache_needs_one_disk_volume_and_a_single_process_worker() {
        use crate::crd::{KvCacheSpec, KvDiskSpec, KvDiskVolume};
        use k8s_openapi::api::core::v1::EmptyDirVolumeSource;
        let mut s = spec();
        s.decode.kv_cache = Some(KvCacheSpec {
            host_memory: None,
            disk: Some(KvDiskSpec {
                size: "1Gi".into(),
                min_uses: None,
                volume: KvDiskVolume::default(),
            }),
        });
        s.prefill.kv_cache = Some(KvCacheSpec {
            host_memory: Some("1Gi".into()),
            disk: Some(KvDiskSpec {
                size: "1Gi".into(),
                min_uses: None,
                volume: KvDiskVolume {
                    empty_dir: Some(EmptyDirVolumeSource::default()),
                    ..Default::default()
                },
            }),
        });
        s.prefill.parallelism.tensor = 2;
        let f = validate(&s);
        assert_eq!(f.errors.len(), 2, "{f:?}");
        assert!(f.errors[0].contains("prefill.kvCache") && f.errors[0].contains("groups"));
        assert!(f.errors[1].contains("decode.kvCache.disk.volume"));
    }

    #[test]
    fn a_plain_spec_is_valid() {
        assert_eq!(validate(&spec()), Findings::default());
    }

    #[test]
    fn inconsistent_pools_are_reported() {
        let mut s = spec();
        s.decode.replicas = Some(2);
        s.decode.autoscaling = Some(PoolAutoscaling {
            min_replicas: 5,
            max_replicas: 3,
        });
        s.prefill.parallelism = Parallelism {
            tensor: 4,
            expert: 1,
            nodes_per_group: 3,
        };
        let f = validate(&s);
        assert!(f.errors.iter().any(|e| e.contains("not both")), "{f:?}");
        assert!(f
            .errors
            .iter()
            .any(|e| e.contains("minReplicas 5 > maxReplicas 3")));
        assert!(f
            .errors
            .iter()
            .any(|e| e.contains("not divisible by nodesPerGroup 3")));
        assert!(f.notes.iter().any(|n| n.contains("attention heads")));
    }

    #[test]
    fn gpu_count_must_match_ranks_per_node() {
        let mut s = spec();
        s.decode.parallelism = Parallelism {
            tensor: 8,
            expert: 2,
            nodes_per_group: 2,
        };
        let res = |n: &str| ResourceRequirements {
            limits: Some(BTreeMap::from([(
                GPU_RESOURCE.to_string(),
                Quantity(n.into()),
            )])),
            ..Default::default()
        };
        s.decode.resources = Some(res("8"));
        let f = validate(&s);
        assert!(f.errors.is_empty());
        assert!(
            f.notes.iter().any(|n| n.contains("no GPU kernels yet")),
            "a GPU spec must say cleave computes on CPUs: {f:?}"
        );
        s.decode.resources = Some(res("4"));
        let f = validate(&s);
        assert!(f.errors[0].contains("8 devices per pod"), "{f:?}");
    }

    #[test]
    fn no_source_and_no_decode_are_errors() {
        let mut s = spec();
        s.model.source.path = None;
        s.decode.replicas = Some(0);
        let f = validate(&s);
        assert_eq!(f.errors.len(), 2, "{f:?}");
    }
}
