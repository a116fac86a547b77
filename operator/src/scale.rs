//! Queue-depth autoscaling, pure: (current groups, bounds, queue depth, policy, recent
//! recommendations, now) → the new group count and why.

use crate::crd::AutoscalingSpec;

/// The worker gauge summed over a pool: sequences waiting for admission.
pub const QUEUE_METRIC: &str = "cleave_worker_queue_depth";

/// One past recommendation (unix seconds, groups).
pub type Recommendation = (u64, i32);

/// What the scaler decided.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// Groups to run.
    pub to: i32,
    /// The raw recommendation within bounds, before stabilisation and step limits.
    pub recommended: i32,
    /// Why, for status and events.
    pub reason: String,
}

/// Input of one decision.
#[derive(Clone, Debug)]
pub struct ScaleInput<'a> {
    /// Groups running now.
    pub current: i32,
    /// Lower bound.
    pub min: i32,
    /// Upper bound.
    pub max: i32,
    /// Queue depth summed over the pool's workers.
    pub queue_depth: f64,
    /// The policy.
    pub policy: &'a AutoscalingSpec,
    /// Recommendations of earlier periods, oldest first (including or not the current one).
    pub history: &'a [Recommendation],
    /// Unix seconds now.
    pub now: u64,
}

/// Decides the group count. The caller appends `(now, recommended)` to the history.
pub fn decide(i: &ScaleInput<'_>) -> Decision {
    let target = f64::from(i.policy.target_queue_depth.max(1));
    let raw = if i.queue_depth.is_finite() && i.queue_depth > 0.0 {
        (i.queue_depth / target).ceil().min(1e6) as i32
    } else {
        0
    };
    let recommended = raw.clamp(i.min, i.max);
    if i.current < i.min || i.current > i.max {
        return Decision {
            to: i.current.clamp(i.min, i.max),
            recommended,
            reason: format!(
                "{} groups is outside the bounds [{}, {}]",
                i.current, i.min, i.max
            ),
        };
    }
    let within = |secs: u32| {
        let since = i.now.saturating_sub(u64::from(secs));
        i.history
            .iter()
            .filter(move |(t, _)| *t >= since)
            .map(|(_, r)| *r)
            .chain(std::iter::once(recommended))
    };
    let queue = format!(
        "queue depth {:.0} / target {} per group → {raw}",
        i.queue_depth, i.policy.target_queue_depth
    );
    if recommended > i.current {
        let window = i.policy.scale_up_stabilization_seconds;
        let stable = within(window).min().unwrap_or(recommended).max(i.current);
        let step = i.current + i.policy.max_scale_up_step as i32;
        let to = stable.min(step);
        let mut reason = format!("scale up: {queue}");
        if stable < recommended {
            reason += &format!("; held to {stable} by the {window}s up-stabilisation window");
        }
        if to < stable {
            reason += &format!("; limited to +{} per step", i.policy.max_scale_up_step);
        }
        Decision {
            to,
            recommended,
            reason,
        }
    } else if recommended < i.current {
        let window = i.policy.scale_down_stabilization_seconds;
        let stable = within(window).max().unwrap_or(recommended).min(i.current);
        let step = i.current - i.policy.max_scale_down_step as i32;
        let to = stable.max(step);
        let mut reason = format!("scale down: {queue}");
        if stable > recommended {
            reason += &format!("; held at {stable} by the {window}s down-stabilisation window");
        }
        if to > stable {
            reason += &format!("; limited to -{} per step", i.policy.max_scale_down_step);
        }
        Decision {
            to,
            recommended,
            reason,
        }
    } else {
        Decision {
            to: i.current,
            recommended,
            reason: format!("steady: {queue}"),
        }
    }
}

/// Drops recommendations older than both windows.
pub fn prune(history: &mut Vec<Recommendation>, policy: &AutoscalingSpec, now: u64) {
    let keep = policy
        .scale_up_stabilization_seconds
        .max(policy.scale_down_stabilization_seconds);
    let since = now.saturating_sub(u64::from(keep));
    history.retain(|(t, _)| *t >= since);
}

/// Sums the samples of `metric` in a Prometheus text exposition (any labels).
pub fn sum_metric(text: &str, metric: &str) -> Option<f64> {
    let mut total = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(metric) else {
            continue;
        };
        let value = if let Some(labelled) = rest.strip_prefix('{') {
            labelled.split_once('}').map(|(_, v)| v)
        } else if rest.starts_with(' ') {
            Some(rest)
        } else {
            None
        };
        if let Some(v) = value.and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok()) {
            *total.get_or_insert(0.0) += v;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> AutoscalingSpec {
        AutoscalingSpec {
            target_queue_depth: 4,
            scale_up_stabilization_seconds: 0,
            scale_down_stabilization_seconds: 60,
            max_scale_up_step: 2,
            max_scale_down_step: 1,
            period_seconds: 15,
        }
    }

    fn decide_with(
        current: i32,
        queue: f64,
        history: &[Recommendation],
        p: &AutoscalingSpec,
    ) -> Decision {
        decide(&ScaleInput {
            current,
            min: 1,
            max: 10,
            queue_depth: queue,
            policy: p,
            history,
            now: 1000,
        })
    }

    #[test]
    fn scales_up_to_queue_over_target_limited_by_step() {
        let p = policy();
        let d = decide_with(1, 12.0, &[], &p);
        assert_eq!((d.recommended, d.to), (3, 3), "{d:?}");
        let d = decide_with(1, 40.0, &[], &p);
        assert_eq!((d.recommended, d.to), (10, 3), "{d:?}");
        assert!(d.reason.contains("+2 per step"), "{}", d.reason);
        let d = decide_with(2, 400.0, &[], &p);
        assert_eq!(d.recommended, 10, "bounded by max");
    }

    #[test]
    fn scale_down_waits_for_the_window_and_steps_by_one() {
        let p = policy();
        // A high recommendation 30 s ago (inside the 60 s window) holds the count.
        let d = decide_with(5, 0.0, &[(970, 5)], &p);
        assert_eq!(d.to, 5, "{d:?}");
        assert!(d.reason.contains("down-stabilisation"), "{}", d.reason);
        // Once it is older than the window, scale down one step.
        let d = decide_with(5, 0.0, &[(900, 5)], &p);
        assert_eq!((d.recommended, d.to), (1, 4), "{d:?}");
    }

    #[test]
    fn up_window_uses_the_lowest_recent_recommendation() {
        let mut p = policy();
        p.scale_up_stabilization_seconds = 60;
        p.max_scale_up_step = 100;
        let d = decide_with(2, 40.0, &[(950, 4), (980, 6)], &p);
        assert_eq!(d.to, 4, "{d:?}");
    }

    #[test]
    fn out_of_bounds_counts_are_clamped_at_once() {
        let p = policy();
        let d = decide(&ScaleInput {
            current: 20,
            min: 2,
            max: 6,
            queue_depth: 0.0,
            policy: &p,
            history: &[],
            now: 0,
        });
        assert_eq!(d.to, 6);
        assert!(d.reason.contains("outside the bounds"));
    }

    #[test]
    fn steady_when_matching() {
        let p = policy();
        assert_eq!(decide_with(3, 10.0, &[], &p).to, 3);
        assert!(decide_with(3, f64::NAN, &[(1000, 3)], &p).to <= 3);
    }

    #[test]
    fn prometheus_text_is_summed_over_labels() {
        let text = "# HELP cleave_worker_queue_depth waiting\n# TYPE cleave_worker_queue_depth gauge\ncleave_worker_queue_depth 3\ncleave_worker_queue_depth_other 100\ncleave_worker_queue_depth{pool=\"a\"} 2.5\n";
        assert_eq!(sum_metric(text, QUEUE_METRIC), Some(5.5));
        assert_eq!(sum_metric("nothing 1\n", QUEUE_METRIC), None);
    }

    #[test]
    fn prune_keeps_the_longest_window() {
        let p = policy();
        let mut h = vec![(100, 1), (950, 2), (990, 3)];
        prune(&mut h, &p, 1000);
        assert_eq!(h, vec![(950, 2), (990, 3)]);
    }
}
