//! The router's configuration: the flags are [`cleave_config::router`]'s (the operator renders
//! them without linking the router); this adds the checks that need the router's own parsers.

pub use cleave_config::router::*;
pub use cleave_config::ConfigError;

pub use crate::events::engine_pods;

/// Why the router's configuration is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ValidateError {
    /// The flags alone are incomplete or contradictory.
    #[error(transparent)]
    Flags(#[from] ConfigError),
    /// A `--kv-events-pod` does not parse.
    #[error("--kv-events-pod: {0}")]
    Pod(#[from] crate::events::PodSpecError),
}

/// [`RouterConfig::validate`], and in `--kv-events` mode the pods' specs too.
pub fn validate(config: &RouterConfig) -> Result<(), ValidateError> {
    config.validate()?;
    if config.kv_events.is_some() {
        engine_pods(config)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_events_pods_are_parsed_with_the_port_defaults() {
        let parse = |args: &[&str]| {
            RouterConfig::from_flags([&["--model", "m.gguf"], args].concat()).expect("flags parse")
        };
        let pod = "--kv-events-pod=http://10.0.0.1:8000";
        let pool = parse(&["--kv-events=vllm", pod, "--kv-events-replay-port=5558"]);
        assert_eq!(validate(&pool), Ok(()));
        let pods = engine_pods(&pool).unwrap();
        assert_eq!(pods[0].events.events, "tcp://10.0.0.1:5557");
        assert_eq!(
            pods[0].events.replay.as_deref(),
            Some("tcp://10.0.0.1:5558")
        );
        let bad = parse(&["--kv-events", "vllm", "--kv-events-pod", "h:1"]);
        assert_eq!(bad.validate(), Ok(()), "the flags alone are complete");
        assert!(validate(&bad).unwrap_err().to_string().contains("http://"));
    }
}
