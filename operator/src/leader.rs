//! Leader election on a coordination.k8s.io/v1 Lease, so two operator replicas can run: one
//! reconciles, the other waits. Writes use the Lease's resourceVersion (optimistic locking), so
//! two candidates never both win.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, PostParams};
use kube::Client;

/// One candidate for a Lease.
#[derive(Clone)]
pub struct LeaseLock {
    api: Api<Lease>,
    name: String,
    identity: String,
    ttl: Duration,
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

impl LeaseLock {
    /// A candidate `identity` for Lease `name` in `ns`, held for `ttl` without renewal.
    pub fn new(client: Client, ns: &str, name: &str, identity: &str, ttl: Duration) -> Self {
        Self {
            api: Api::namespaced(client, ns),
            name: name.into(),
            identity: identity.into(),
            ttl,
        }
    }

    /// How long the lease lasts unrenewed.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Acquires the Lease if it is free, expired or already ours (renewing it); `Ok(false)` when
    /// someone else holds it.
    pub async fn try_acquire(&self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let secs = self.ttl.as_secs().max(1) as i32;
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(secs),
                    acquire_time: Some(MicroTime(now)),
                    renew_time: Some(MicroTime(now)),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(e) if is_conflict(&e) => Ok(false),
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let ours = holder == self.identity;
        let expired = match (&spec.renew_time, spec.lease_duration_seconds) {
            (Some(MicroTime(t)), Some(d)) => *t + SignedDuration::from_secs(i64::from(d)) < now,
            _ => true,
        };
        if !ours && !holder.is_empty() && !expired {
            return Ok(false);
        }
        if !ours {
            spec.acquire_time = Some(MicroTime(now));
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            spec.holder_identity = Some(self.identity.clone());
        }
        spec.renew_time = Some(MicroTime(now));
        spec.lease_duration_seconds = Some(secs);
        // `replace` carries metadata.resourceVersion: a concurrent writer makes this a 409.
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if is_conflict(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Gives the Lease up (if ours) so a standby takes over at once.
    pub async fn release(&self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            return Ok(());
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        if spec.holder_identity.as_deref() != Some(&self.identity) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.renew_time = None;
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if is_conflict(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Waits until this candidate holds the Lease.
    pub async fn acquire(&self) {
        loop {
            match self.try_acquire().await {
                Ok(true) => return,
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "leader election"),
            }
            tokio::time::sleep(self.ttl / 3).await;
        }
    }

    /// Renews every ttl/3; returns when the Lease is lost (taken, or not renewed for a ttl).
    pub async fn hold(&self) {
        let mut last_ok = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(self.ttl / 3).await;
            match self.try_acquire().await {
                Ok(true) => last_ok = tokio::time::Instant::now(),
                Ok(false) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "renewing the leader lease");
                    if last_ok.elapsed() >= self.ttl {
                        return;
                    }
                }
            }
        }
    }
}
