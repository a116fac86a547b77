//! cleave's own counters, read from `/metrics` before and after a load point: the workers'
//! prefix-cache hit and query tokens (`cleave_prefix_cache_{hit,query}_tokens_total`) and the
//! router's placements by mode (`cleave_router_placements_total{mode=...}`).

use serde::Serialize;

/// Sums every sample of `name` (any labels) whose label set contains `label` (e.g.
/// `mode="local"`), in Prometheus text format. None when the metric is absent.
pub fn sum_metric(text: &str, name: &str, label: Option<&str>) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (labels, value) = if let Some(r) = rest.strip_prefix('{') {
            match r.split_once('}') {
                Some((l, v)) => (l, v),
                None => continue,
            }
        } else if rest.starts_with(' ') {
            ("", rest)
        } else {
            continue; // a longer name with this prefix
        };
        if label.is_some_and(|l| !labels.split(',').any(|x| x.trim() == l)) {
            continue;
        }
        if let Some(v) = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// The counters of one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Counters {
    /// Placements prefilled on a prefill worker.
    pub disaggregated: f64,
    /// Placements prefilled on the decode worker.
    pub local: f64,
    /// Prompt tokens served from workers' prefix caches.
    pub hit_tokens: f64,
    /// Prompt tokens looked up in workers' prefix caches.
    pub query_tokens: f64,
    /// Whether the router's placement counter was there.
    pub router_seen: bool,
    /// Whether any worker's prefix-cache counters were there.
    pub workers_seen: bool,
}

/// What changed between two snapshots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct CleaveDelta {
    /// Prefix-cache hit rate over the load point (hit / query tokens), if workers were read.
    pub prefix_hit_rate: Option<f64>,
    /// Fraction of placements disaggregated, if the router was read.
    pub disaggregated_fraction: Option<f64>,
}

/// Reads the router's and the workers' `/metrics`; missing or unreachable endpoints leave
/// their part unset (the endpoint is not cleave, or not reachable).
pub async fn snapshot(
    client: &reqwest::Client,
    router: Option<&str>,
    workers: &[String],
) -> Counters {
    let mut c = Counters::default();
    if let Some(url) = router {
        if let Some(text) = fetch(client, url).await {
            let d = sum_metric(
                &text,
                "cleave_router_placements_total",
                Some("mode=\"disaggregated\""),
            );
            let l = sum_metric(
                &text,
                "cleave_router_placements_total",
                Some("mode=\"local\""),
            );
            c.router_seen = d.is_some() || l.is_some() || text.contains("cleave_router_");
            c.disaggregated = d.unwrap_or(0.0);
            c.local = l.unwrap_or(0.0);
        }
    }
    for url in workers {
        if let Some(text) = fetch(client, url).await {
            if let (Some(h), Some(q)) = (
                sum_metric(&text, "cleave_prefix_cache_hit_tokens_total", None),
                sum_metric(&text, "cleave_prefix_cache_query_tokens_total", None),
            ) {
                c.workers_seen = true;
                c.hit_tokens += h;
                c.query_tokens += q;
            }
        }
    }
    c
}

async fn fetch(client: &reqwest::Client, url: &str) -> Option<String> {
    let resp = client.get(url).send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    resp.text().await.ok()
}

/// The rates over the interval between `before` and `after`.
pub fn delta(before: &Counters, after: &Counters) -> CleaveDelta {
    let ratio = |a: f64, b: f64| if b > 0.0 { Some(a / b) } else { None };
    CleaveDelta {
        prefix_hit_rate: if after.workers_seen {
            ratio(
                after.hit_tokens - before.hit_tokens,
                after.query_tokens - before.query_tokens,
            )
        } else {
            None
        },
        disaggregated_fraction: if after.router_seen {
            let d = after.disaggregated - before.disaggregated;
            ratio(d, d + after.local - before.local).or(Some(0.0))
        } else {
            None
        },
    }
}
