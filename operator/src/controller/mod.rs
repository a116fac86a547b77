//! The reconciler: validate, decide group counts (autoscaler), render, apply, prune, report.

pub mod apply;
mod autoscale;
pub mod observe;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde_json::json;

use crate::crd::{InferenceService, InferenceServiceStatus};
use crate::metrics::OperatorMetrics;
use crate::render::names::{self, Component, MANAGER};
use crate::render::{self, Inputs};
use crate::scale::Recommendation;
use crate::status::{self, Observation};
use crate::validate;

/// Operator settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Image of the cleave binaries when a spec names none.
    pub default_image: String,
    /// Image of the model download init container.
    pub fetch_image: String,
}

/// What the autoscaler remembers of one pool. The group count and decision this process last
/// made are newer than the status of a cached object that has not seen its own status write
/// yet; a reconcile of such an object must neither flip the pool back nor the recorded
/// decision (a new leader starts from the status).
#[derive(Default)]
struct ScalerMemory {
    /// Recent recommendations.
    history: Vec<Recommendation>,
    /// Unix time of the last decision.
    at: u64,
    /// The group count last decided.
    groups: Option<i32>,
    /// The last decision that changed it.
    record: Option<crate::crd::ScaleDecisionStatus>,
}

/// Shared reconciler state.
pub struct Ctx {
    /// API client.
    pub client: Client,
    /// Settings.
    pub settings: Settings,
    recorder: Recorder,
    failures: Mutex<HashMap<String, u32>>,
    /// Per (object, pool): recent recommendations and the time of the last decision.
    scaler: Mutex<HashMap<(String, Component), ScalerMemory>>,
    http: reqwest::Client,
    /// Counters for /metrics.
    pub metrics: OperatorMetrics,
}

impl Ctx {
    /// A context with no history.
    pub fn new(client: Client, settings: Settings, metrics: OperatorMetrics) -> Self {
        let reporter = Reporter {
            controller: MANAGER.into(),
            // The downward API's pod name, when the chart sets it, names the event reporter.
            #[allow(clippy::disallowed_methods)]
            instance: std::env::var("POD_NAME").ok(),
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            settings,
            failures: Mutex::default(),
            scaler: Mutex::default(),
            http: reqwest::Client::new(),
            metrics,
        }
    }
}

/// Reconcile failures.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server refused a write or read.
    #[error("{stage}: {source}")]
    Kube {
        /// What was being done.
        stage: &'static str,
        /// The API error (409 conflict, 422 invalid, 5xx …).
        #[source]
        source: kube::Error,
    },
}

impl Error {
    /// HTTP status of the API error, if it was one.
    pub fn code(&self) -> Option<u16> {
        match self {
            Error::Kube {
                source: kube::Error::Api(s),
                ..
            } => Some(s.code),
            _ => None,
        }
    }
}

fn key(isvc: &InferenceService) -> String {
    format!(
        "{}/{}",
        isvc.namespace().unwrap_or_default(),
        isvc.name_any()
    )
}

async fn event(ctx: &Ctx, isvc: &InferenceService, type_: EventType, reason: &str, note: String) {
    let ev = Event {
        type_,
        reason: reason.into(),
        note: Some(note.chars().take(1000).collect()),
        action: "Reconcile".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &isvc.object_ref(&())).await {
        tracing::warn!(error = %e, reason, "could not publish event");
    }
}

async fn write_status(
    ctx: &Ctx,
    isvc: &InferenceService,
    obs: &Observation,
) -> Result<InferenceServiceStatus, Error> {
    let now = Timestamp::now().to_string();
    let new = status::compute(isvc.status.as_ref(), obs, &now);
    let api: Api<InferenceService> =
        Api::namespaced(ctx.client.clone(), &isvc.namespace().unwrap_or_default());
    api.patch_status(
        &isvc.name_any(),
        &PatchParams::default(),
        &Patch::Merge(json!({ "status": new })),
    )
    .await
    .map_err(|source| Error::Kube {
        stage: "writing status",
        source,
    })?;
    // Events for transitions of Ready.
    let was = isvc
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"));
    let is = new.conditions.iter().find(|c| c.type_ == "Ready");
    if let Some(is) = is {
        if was.map(|w| (&w.status, &w.reason)) != Some((&is.status, &is.reason)) {
            let degraded = new
                .conditions
                .iter()
                .any(|c| c.type_ == "Degraded" && c.status == "True");
            let t = if degraded {
                EventType::Warning
            } else {
                EventType::Normal
            };
            event(ctx, isvc, t, &is.reason, is.message.clone()).await;
        }
    }
    Ok(new)
}

/// One reconcile of one InferenceService.
pub async fn reconcile(isvc: Arc<InferenceService>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    ctx.metrics.reconciles.inc();
    let name = isvc.name_any();
    let ns = isvc.namespace().unwrap_or_default();
    let findings = validate::validate(&isvc.spec);
    let mut obs = Observation {
        generation: isvc.metadata.generation,
        invalid: findings.errors.clone(),
        notes: findings.notes.clone(),
        endpoint: Some(render::router_endpoint(&isvc)),
        ..Default::default()
    };
    if !obs.invalid.is_empty() {
        write_status(&ctx, &isvc, &obs).await?;
        return Ok(Action::requeue(Duration::from_secs(300)));
    }
    let lws_available = observe::lws_available(&ctx.client).await;
    let (prefill_groups, decode_groups, last_scale) = autoscale::groups(&ctx, &isvc)
        .await
        .map_err(|source| Error::Kube {
            stage: "reading pods for autoscaling",
            source,
        })?;
    obs.last_scale = last_scale;
    let inputs = Inputs {
        default_image: ctx.settings.default_image.clone(),
        fetch_image: ctx.settings.fetch_image.clone(),
        lws_available,
        prefill_groups,
        decode_groups,
    };
    let desired = match render::desired(&isvc, &inputs) {
        Ok(d) => d,
        Err(e) => {
            obs.invalid.push(cleave_telemetry::error_chain(&e));
            write_status(&ctx, &isvc, &obs).await?;
            return Ok(Action::requeue(Duration::from_secs(300)));
        }
    };
    let applied = async {
        let applied = apply::apply_all(&ctx.client, &desired).await?;
        let pruned = apply::prune(&ctx.client, &ns, &name, &desired, lws_available).await?;
        Ok::<_, kube::Error>((applied, pruned))
    }
    .await;
    let (applied, pruned) = match applied {
        Ok(x) => x,
        Err(source) => {
            let err = Error::Kube {
                stage: "applying owned objects",
                source,
            };
            obs.apply_error = Some(err.to_string());
            // Best effort: the error is what matters for back-off.
            let _ = write_status(&ctx, &isvc, &obs).await;
            return Err(err);
        }
    };
    if !pruned.is_empty() {
        let note = format!("deleted {}", pruned.join(", "));
        event(&ctx, &isvc, EventType::Normal, "Pruned", note).await;
    }
    obs.prefill = (
        observe::ready_groups(&applied, &name, Component::Prefill),
        prefill_groups,
    );
    obs.decode = (
        observe::ready_groups(&applied, &name, Component::Decode),
        decode_groups,
    );
    obs.router = (
        observe::ready_groups(&applied, &name, Component::Router),
        isvc.spec.router.replicas,
    );
    let lagging = [obs.prefill, obs.decode, obs.router]
        .iter()
        .any(|(ready, want)| ready < want);
    if lagging {
        obs.problems = observe::pod_problems(&ctx.client, &ns, &name)
            .await
            .map_err(|source| Error::Kube {
                stage: "reading pods for their status",
                source,
            })?;
    }
    write_status(&ctx, &isvc, &obs).await?;
    ctx.failures.lock().unwrap().remove(&key(&isvc));
    let autoscaled =
        isvc.spec.prefill.autoscaling.is_some() || isvc.spec.decode.autoscaling.is_some();
    let period = if autoscaled {
        u64::from(isvc.spec.autoscaling.period_seconds)
    } else {
        300
    };
    Ok(Action::requeue(Duration::from_secs(period)))
}

/// Back-off after a failed reconcile: 1 s, 2 s, 4 s … capped at 5 minutes.
pub fn backoff(failures: u32) -> Duration {
    Duration::from_secs(1u64 << failures.min(8)).min(Duration::from_secs(300))
}

/// Exponential back-off per object.
pub fn error_policy(isvc: Arc<InferenceService>, err: &Error, ctx: Arc<Ctx>) -> Action {
    ctx.metrics.failures.inc();
    let mut f = ctx.failures.lock().unwrap();
    let n = f.entry(key(&isvc)).or_insert(0);
    let delay = backoff(*n);
    *n += 1;
    tracing::warn!(object = %key(&isvc), error = %err, ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// Runs the controller until `shutdown` resolves.
pub async fn run(
    ctx: Arc<Ctx>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let client = ctx.client.clone();
    let wc = watcher::Config::default();
    let owned =
        watcher::Config::default().labels(&format!("app.kubernetes.io/managed-by={MANAGER}"));
    Controller::new(Api::<InferenceService>::all(client.clone()), wc)
        .owns(Api::<Deployment>::all(client.clone()), owned.clone())
        .owns(Api::<StatefulSet>::all(client.clone()), owned.clone())
        .owns(Api::<Service>::all(client.clone()), owned.clone())
        .owns(Api::<ConfigMap>::all(client.clone()), owned.clone())
        // Pod status (an image pull failing, a crash loop) changes nothing the operator owns:
        // watch the pods themselves so the isvc's conditions say why promptly.
        .watches(Api::<Pod>::all(client.clone()), owned, |pod: Pod| {
            let ns = pod.metadata.namespace.clone()?;
            let instance = pod.metadata.labels.as_ref()?.get(names::INSTANCE)?.clone();
            Some(ObjectRef::<InferenceService>::new(&instance).within(&ns))
        })
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "controller event");
            }
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        assert_eq!(backoff(0), Duration::from_secs(1));
        assert_eq!(backoff(3), Duration::from_secs(8));
        assert_eq!(backoff(30), Duration::from_secs(256));
        assert!(backoff(100) <= Duration::from_secs(300));
    }
}
