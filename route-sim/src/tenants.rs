//! A second trace shape: many tenants, each with a long private prefix (a system prompt or a
//! document) followed by a short question of its own, in the shape of llm-d's shared-prefix
//! benchmark (groups of requests sharing a long system prompt). Deterministic for a seed.
//!
//! Request `i` picks a tenant uniformly at random; its prompt is the tenant's `prefix_blocks`
//! blocks (ids shared by every request of that tenant) and `suffix_blocks` blocks of its own;
//! arrivals are Poisson at `rate_per_s` (the simulator rescales time to its offered load anyway).

use super::TraceRequest;
use cleave_place::rng::SharedRng;

/// Parameters of the tenant trace.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TenantTrace {
    pub tenants: u64,
    pub prefix_blocks: u64,
    pub suffix_blocks: u64,
    pub requests: usize,
    pub output_tokens: u64,
    pub block_tokens: u64,
    pub rate_per_s: f64,
    pub seed: u64,
}

impl Default for TenantTrace {
    /// 128 tenants × 16-block (8,192-token) prefixes, 2-block (1,024-token) questions, 128 output
    /// tokens, 4,000 requests.
    fn default() -> Self {
        Self {
            tenants: 128,
            prefix_blocks: 16,
            suffix_blocks: 2,
            requests: 4_000,
            output_tokens: 128,
            block_tokens: 512,
            rate_per_s: 4.0,
            seed: 0x7e4a47,
        }
    }
}

impl TenantTrace {
    /// The requests, by arrival.
    pub fn generate(&self) -> Vec<TraceRequest> {
        let rng = SharedRng::new(self.seed);
        let tenants = self.tenants.max(1);
        let suffix_base = tenants * self.prefix_blocks;
        let mut t_ms = 0.0f64;
        (0..self.requests)
            .map(|i| {
                let tenant = rng.next_u64() % tenants;
                // Exponential gap from a uniform in (0, 1].
                let u = ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
                t_ms += -u.ln() / self.rate_per_s.max(f64::MIN_POSITIVE) * 1e3;
                let prefix = (0..self.prefix_blocks).map(|j| tenant * self.prefix_blocks + j);
                let own = i as u64 * self.suffix_blocks;
                let suffix = (0..self.suffix_blocks).map(|j| suffix_base + own + j);
                TraceRequest {
                    timestamp: t_ms as u64,
                    input_length: (self.prefix_blocks + self.suffix_blocks) * self.block_tokens,
                    output_length: self.output_tokens,
                    hash_ids: prefix.chain(suffix).collect(),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_share_their_prefix_and_nothing_else() {
        let cfg = TenantTrace {
            requests: 500,
            ..TenantTrace::default()
        };
        let t = cfg.generate();
        assert_eq!(t, cfg.generate(), "deterministic");
        assert_eq!(t.len(), 500);
        assert!(t.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        for r in &t {
            assert_eq!(r.hash_ids.len(), 18);
            let tenant = r.hash_ids[0] / 16;
            assert!(tenant < 128);
            assert_eq!(
                r.hash_ids[..16],
                (tenant * 16..tenant * 16 + 16).collect::<Vec<_>>()[..]
            );
        }
        let mut suffixes: Vec<u64> = t.iter().flat_map(|r| r.hash_ids[16..].to_vec()).collect();
        suffixes.sort_unstable();
        suffixes.dedup();
        assert_eq!(suffixes.len(), 1_000, "questions are private");
        let tenants: std::collections::HashSet<u64> = t.iter().map(|r| r.hash_ids[0]).collect();
        assert!(tenants.len() > 100, "{}", tenants.len());
    }
}
