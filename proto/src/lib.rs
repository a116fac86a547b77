//! cleave's control-plane API, generated from `proto/cleave/v1/worker.proto` (the documented
//! contract): the decode worker's `Generate`/`Watch`, the prefill worker's `Prefill`/`Watch`.

#![allow(missing_docs, clippy::all)]

/// Package `cleave.v1`.
pub mod v1 {
    tonic::include_proto!("cleave.v1");
}

/// Between the wire's sampling parameters and the engine's, in both directions.
pub mod convert {
    use cleave_engine::sample::SamplingParams;

    use crate::v1 as pb;

    /// The engine's sampling parameters from the wire (`top_p` 0 means unset); validation is
    /// the caller's (`SamplingParams::validate`).
    pub fn sampling_from_wire(p: pb::SamplingParams) -> SamplingParams {
        SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k as usize,
            top_p: if p.top_p == 0.0 { 1.0 } else { p.top_p },
            seed: p.seed,
            max_tokens: p.max_tokens as usize,
            stop: p.stop,
            stop_token_ids: p.stop_token_ids,
            ignore_eos: p.ignore_eos,
            logprobs: p.logprobs.map(|n| n as usize),
        }
    }

    /// The wire form of the engine's sampling parameters.
    pub fn sampling_to_wire(p: &SamplingParams) -> pb::SamplingParams {
        pb::SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k as u32,
            top_p: p.top_p,
            seed: p.seed,
            max_tokens: p.max_tokens as u32,
            stop: p.stop.clone(),
            stop_token_ids: p.stop_token_ids.clone(),
            ignore_eos: p.ignore_eos,
            logprobs: p.logprobs.map(|n| n as u32),
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn round_trip() {
            let p = SamplingParams {
                temperature: 0.7,
                top_k: 40,
                top_p: 0.9,
                seed: Some(3),
                max_tokens: 12,
                stop: vec!["x".into()],
                stop_token_ids: vec![2],
                ignore_eos: true,
                logprobs: Some(2),
            };
            assert_eq!(sampling_from_wire(sampling_to_wire(&p)), p);
            assert_eq!(sampling_from_wire(pb::SamplingParams::default()).top_p, 1.0);
        }
    }
}
