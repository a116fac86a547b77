//! Status conditions from what was observed, pure.

use crate::crd::{Condition, InferenceServiceStatus, PoolStatus, ScaleDecisionStatus};
use crate::problems::Problem;

/// What one reconcile saw.
#[derive(Clone, Debug, Default)]
pub struct Observation {
    /// Spec generation.
    pub generation: Option<i64>,
    /// Spec errors (schema-inexpressible) or a render failure: nothing is applied.
    pub invalid: Vec<String>,
    /// Things the operator could not check.
    pub notes: Vec<String>,
    /// Applying failed with this message.
    pub apply_error: Option<String>,
    /// (ready, desired) per pool and the router.
    pub prefill: (i32, i32),
    /// Decode counts.
    pub decode: (i32, i32),
    /// Router counts.
    pub router: (i32, i32),
    /// The router's URL.
    pub endpoint: Option<String>,
    /// Latest autoscaler decision (kept from the old status when none now).
    pub last_scale: Option<ScaleDecisionStatus>,
    /// Why pods are not running (image pulls, crashes, OOM kills, scheduling).
    pub problems: Vec<Problem>,
}

fn cond(type_: &str, status: bool, reason: &str, message: String) -> Condition {
    Condition {
        type_: type_.into(),
        status: if status { "True" } else { "False" }.into(),
        reason: reason.into(),
        message,
        ..Default::default()
    }
}

/// The new status; `lastTransitionTime` carries over from `old` when a condition's status is
/// unchanged, else it is `now`.
pub fn compute(
    old: Option<&InferenceServiceStatus>,
    o: &Observation,
    now: &str,
) -> InferenceServiceStatus {
    let pools = [
        ("prefill", o.prefill),
        ("decode", o.decode),
        ("router", o.router),
    ];
    let lagging: Vec<String> = pools
        .iter()
        .filter(|(_, (r, d))| r < d)
        .map(|(n, (r, d))| format!("{n} {r}/{d}"))
        .collect();
    let notes = o.notes.join("; ");
    let conditions = if !o.invalid.is_empty() {
        let msg = o.invalid.join("; ");
        vec![
            cond("Ready", false, "InvalidSpec", msg.clone()),
            cond("Progressing", false, "InvalidSpec", "fix the spec".into()),
            cond("Degraded", true, "InvalidSpec", msg),
        ]
    } else if let Some(err) = &o.apply_error {
        vec![
            cond("Ready", false, "ReconcileError", err.clone()),
            cond(
                "Progressing",
                true,
                "Retrying",
                "retrying with back-off".into(),
            ),
            cond("Degraded", true, "ReconcileError", err.clone()),
        ]
    } else if lagging.is_empty() {
        vec![
            cond("Ready", true, "AllReplicasReady", notes.clone()),
            cond("Progressing", false, "Complete", String::new()),
            cond("Degraded", false, "AsExpected", notes),
        ]
    } else if let Some(first) = o.problems.first() {
        let why: Vec<&str> = o.problems.iter().map(|p| p.message.as_str()).collect();
        let msg = format!("waiting for {}: {}", lagging.join(", "), why.join("; "));
        let reason = first.kind.reason();
        let degraded = if notes.is_empty() {
            msg.clone()
        } else {
            format!("{msg}; {notes}")
        };
        vec![
            cond("Ready", false, reason, msg),
            cond(
                "Progressing",
                true,
                "Rolling",
                format!("waiting for {}", lagging.join(", ")),
            ),
            cond("Degraded", true, reason, degraded),
        ]
    } else {
        let msg = format!("waiting for {}", lagging.join(", "));
        vec![
            cond("Ready", false, "ReplicasNotReady", msg.clone()),
            cond("Progressing", true, "Rolling", msg),
            cond("Degraded", false, "AsExpected", notes),
        ]
    };
    let conditions = conditions
        .into_iter()
        .map(|mut c| {
            let prev = old.and_then(|s| s.conditions.iter().find(|p| p.type_ == c.type_));
            c.last_transition_time = match prev {
                Some(p) if p.status == c.status => p.last_transition_time.clone(),
                _ => Some(now.to_string()),
            };
            c.observed_generation = o.generation;
            c
        })
        .collect();
    InferenceServiceStatus {
        observed_generation: o.generation,
        conditions,
        prefill: PoolStatus::new(o.prefill.0, o.prefill.1),
        decode: PoolStatus::new(o.decode.0, o.decode.1),
        router: PoolStatus::new(o.router.0, o.router.1),
        router_endpoint: o.endpoint.clone(),
        last_scale: o
            .last_scale
            .clone()
            .or_else(|| old.and_then(|s| s.last_scale.clone())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get<'a>(s: &'a InferenceServiceStatus, t: &str) -> &'a Condition {
        s.conditions.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn ready_when_every_pool_is() {
        let o = Observation {
            generation: Some(3),
            prefill: (1, 1),
            decode: (2, 2),
            router: (1, 1),
            ..Default::default()
        };
        let s = compute(None, &o, "t0");
        assert_eq!(get(&s, "Ready").status, "True");
        assert_eq!(get(&s, "Ready").observed_generation, Some(3));
        assert_eq!(s.decode.summary, "2/2");
        assert_eq!(s.observed_generation, Some(3));
    }

    #[test]
    fn lagging_pools_are_progressing_and_transitions_are_timed() {
        let o = Observation {
            prefill: (1, 1),
            decode: (0, 2),
            router: (1, 1),
            ..Default::default()
        };
        let s1 = compute(None, &o, "t0");
        assert_eq!(get(&s1, "Ready").reason, "ReplicasNotReady");
        assert!(get(&s1, "Progressing").message.contains("decode 0/2"));
        let s2 = compute(Some(&s1), &o, "t1");
        assert_eq!(
            get(&s2, "Ready").last_transition_time.as_deref(),
            Some("t0")
        );
        let ready = Observation {
            decode: (2, 2),
            ..o
        };
        let s3 = compute(Some(&s2), &ready, "t2");
        assert_eq!(
            get(&s3, "Ready").last_transition_time.as_deref(),
            Some("t2")
        );
    }

    #[test]
    fn pod_problems_name_the_reason_while_waiting() {
        use crate::problems::{Problem, ProblemKind};
        let o = Observation {
            decode: (0, 1),
            problems: vec![Problem {
                kind: ProblemKind::ImagePull,
                message: "pod m-decode-0 container worker: ErrImagePull: not found".into(),
            }],
            ..Default::default()
        };
        let s = compute(None, &o, "t");
        let ready = get(&s, "Ready");
        assert_eq!(ready.reason, "ImagePullFailed");
        assert_eq!(
            ready.message,
            "waiting for decode 0/1: pod m-decode-0 container worker: ErrImagePull: not found"
        );
        assert_eq!(get(&s, "Degraded").status, "True");
        // Once the pool is ready, a stale problem no longer matters.
        let o = Observation {
            decode: (1, 1),
            ..o
        };
        assert_eq!(get(&compute(None, &o, "t"), "Ready").status, "True");
    }

    #[test]
    fn invalid_specs_are_degraded_with_the_reason() {
        let o = Observation {
            invalid: vec!["decode.autoscaling: minReplicas 5 > maxReplicas 3".into()],
            ..Default::default()
        };
        let s = compute(None, &o, "t");
        assert_eq!(get(&s, "Degraded").status, "True");
        assert_eq!(get(&s, "Ready").reason, "InvalidSpec");
        assert!(get(&s, "Ready").message.contains("minReplicas"));
    }
}
