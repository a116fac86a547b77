//! Group counts per pool: the spec's replicas, or the autoscaler's decision recorded in status
//! (the InferenceService is the source of truth; workloads are always applied with it).

use kube::ResourceExt;

use super::{event, observe, Ctx};
use crate::crd::{InferenceService, PoolSpec, PoolStatus, ScaleDecisionStatus};
use crate::render::fixed_groups;
use crate::render::names::Component;
use crate::scale::{decide, prune, ScaleInput};
use kube::runtime::events::EventType;

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn pool_groups(
    ctx: &Ctx,
    isvc: &InferenceService,
    c: Component,
    pool: &PoolSpec,
    last: Option<&PoolStatus>,
) -> Result<(i32, Option<ScaleDecisionStatus>), kube::Error> {
    let Some(bounds) = &pool.autoscaling else {
        return Ok((fixed_groups(pool), None));
    };
    let policy = &isvc.spec.autoscaling;
    let now = unix_now();
    let key = (
        format!(
            "{}/{}",
            isvc.namespace().unwrap_or_default(),
            isvc.name_any()
        ),
        c,
    );
    let (due, remembered, last_record) = {
        let s = ctx.scaler.lock().unwrap();
        let m = s.get(&key);
        let due = m.is_none_or(|m| now >= m.at + u64::from(policy.period_seconds));
        (
            due,
            m.and_then(|m| m.groups),
            m.and_then(|m| m.record.clone()),
        )
    };
    // A reconcile between periods may see a cached object whose status predates the last
    // decision: what this process decided last wins over it, or the pool would flip back.
    let current = remembered.unwrap_or_else(|| {
        last.filter(|s| s.desired > 0 || bounds.min_replicas == 0)
            .map(|s| s.desired)
            .unwrap_or(bounds.min_replicas)
    });
    if !due {
        return Ok((
            current.clamp(bounds.min_replicas, bounds.max_replicas),
            last_record,
        ));
    }
    let ns = isvc.namespace().unwrap_or_default();
    let depth = observe::pool_queue_depth(&ctx.client, &ctx.http, &ns, &isvc.name_any(), c).await?;
    let Some(depth) = depth else {
        // No metrics (no ready worker answered): keep the count, within bounds.
        return Ok((
            current.clamp(bounds.min_replicas, bounds.max_replicas),
            None,
        ));
    };
    let decision = {
        let mut s = ctx.scaler.lock().unwrap();
        let entry = s.entry(key.clone()).or_default();
        prune(&mut entry.history, policy, now);
        let d = decide(&ScaleInput {
            current,
            min: bounds.min_replicas,
            max: bounds.max_replicas,
            queue_depth: depth,
            policy,
            history: &entry.history,
            now,
        });
        entry.history.push((now, d.recommended));
        entry.at = now;
        entry.groups = Some(d.to);
        d
    };
    if decision.to == current {
        return Ok((current, last_record));
    }
    ctx.metrics.scale_decisions.inc();
    let record = ScaleDecisionStatus {
        pool: c.as_str().into(),
        from: current,
        to: decision.to,
        queue_depth: depth,
        reason: decision.reason.clone(),
        time: k8s_openapi::jiff::Timestamp::now().to_string(),
    };
    let note = format!(
        "{} {} → {}: {}",
        c.as_str(),
        current,
        decision.to,
        decision.reason
    );
    event(ctx, isvc, EventType::Normal, "Scaled", note).await;
    if let Some(m) = ctx.scaler.lock().unwrap().get_mut(&key) {
        m.record = Some(record.clone());
    }
    Ok((decision.to, Some(record)))
}

/// (prefill groups, decode groups, a new scale decision if one was made).
pub async fn groups(
    ctx: &Ctx,
    isvc: &InferenceService,
) -> Result<(i32, i32, Option<ScaleDecisionStatus>), kube::Error> {
    let st = isvc.status.as_ref();
    let (p, pd) = pool_groups(
        ctx,
        isvc,
        Component::Prefill,
        &isvc.spec.prefill,
        st.map(|s| &s.prefill),
    )
    .await?;
    let (d, dd) = pool_groups(
        ctx,
        isvc,
        Component::Decode,
        &isvc.spec.decode,
        st.map(|s| &s.decode),
    )
    .await?;
    // The later of the two pools' decisions (RFC 3339 times in one format order as text).
    let last = match (pd, dd) {
        (Some(a), Some(b)) => Some(if a.time > b.time { a } else { b }),
        (a, b) => a.or(b),
    };
    Ok((p, d, last))
}
