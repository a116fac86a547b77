//! Worker and router configuration rendered as `CLEAVE_*` environment (a ConfigMap consumed by
//! `envFrom`). Names come from the binaries' own clap definitions (`WorkerConfig`,
//! `RouterConfig`), and every rendered set is parsed back through them, so the ConfigMap holds
//! only settings the binaries accept, with values they accept.

use std::collections::BTreeMap;

use clap::{Args, Command, FromArgMatches};
use cleave_config::router::RouterConfig;
use cleave_config::worker::WorkerConfig;

/// A rendered setting the binary would reject.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// No such field in the binary's config.
    #[error("{binary} has no setting {id:?}")]
    UnknownSetting { binary: &'static str, id: String },
    /// The field has no environment variable (flag only).
    #[error("{binary} setting {id:?} has no CLEAVE_* variable")]
    NoEnv { binary: &'static str, id: String },
    /// The binary's parser rejected the value.
    #[error("{binary} rejects the rendered config: {message}")]
    Rejected {
        binary: &'static str,
        message: String,
    },
}

/// Clap's view of a config type, with environment reading turned off (the operator's own
/// environment must not leak into what it renders).
fn command<T: Args>(binary: &'static str) -> Command {
    T::augment_args(Command::new(binary))
        .no_binary_name(true)
        .mut_args(|a| a.env(None))
}

/// Renders `(field id, value)` pairs of config type `T` into `CLEAVE_*` variables and checks them
/// by parsing them as the binary would; returns the variables and the parsed config.
fn render<T: Args + FromArgMatches>(
    binary: &'static str,
    settings: &[(&str, String)],
) -> Result<(BTreeMap<String, String>, T), ConfigError> {
    let with_env = T::augment_args(Command::new(binary));
    let mut env = BTreeMap::new();
    let mut argv = Vec::new();
    for (id, value) in settings {
        let arg = with_env
            .get_arguments()
            .find(|a| a.get_id().as_str() == *id)
            .ok_or_else(|| ConfigError::UnknownSetting {
                binary,
                id: id.to_string(),
            })?;
        let name = arg.get_env().ok_or_else(|| ConfigError::NoEnv {
            binary,
            id: id.to_string(),
        })?;
        env.insert(name.to_string_lossy().into_owned(), value.clone());
        let long = arg.get_long().expect("config settings have long flags");
        argv.push(format!("--{long}={value}"));
    }
    let matches = command::<T>(binary)
        .try_get_matches_from(argv)
        .map_err(|e| ConfigError::Rejected {
            binary,
            message: e.to_string().lines().next().unwrap_or_default().to_string(),
        })?;
    let parsed = T::from_arg_matches(&matches).map_err(|e| ConfigError::Rejected {
        binary,
        message: e.to_string(),
    })?;
    Ok((env, parsed))
}

/// Worker environment from `(WorkerConfig field, value)` pairs.
pub fn worker_env(
    settings: &[(&str, String)],
) -> Result<(BTreeMap<String, String>, WorkerConfig), ConfigError> {
    render::<WorkerConfig>("cleave-worker", settings)
}

/// Router environment from `(RouterConfig field, value)` pairs.
pub fn router_env(
    settings: &[(&str, String)],
) -> Result<(BTreeMap<String, String>, RouterConfig), ConfigError> {
    render::<RouterConfig>("cleave-router", settings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_settings_become_its_env_and_parse_back() {
        let (env, cfg) = worker_env(&[
            ("model", "/models/m.gguf".into()),
            ("kv_blocks", "64".into()),
            ("grpc_addr", "0.0.0.0:50051".into()),
        ])
        .unwrap();
        assert_eq!(env["CLEAVE_MODEL"], "/models/m.gguf");
        assert_eq!(env["CLEAVE_KV_BLOCKS"], "64");
        assert_eq!(cfg.kv_blocks, Some(64));
        assert_eq!(cfg.grpc_addr.port(), 50051);
    }

    #[test]
    fn bad_values_and_unknown_settings_are_errors() {
        let e = worker_env(&[("model", "m".into()), ("kv_blocks", "lots".into())]).unwrap_err();
        assert!(e.to_string().contains("rejects"), "{e}");
        let e = worker_env(&[("model", "m".into()), ("colour", "red".into())]).unwrap_err();
        assert!(e.to_string().contains("colour"), "{e}");
        // The router's worker lists are flag-only: they cannot go in a ConfigMap.
        let e = router_env(&[("model", "m".into()), ("decode", "x".into())]).unwrap_err();
        assert!(matches!(e, ConfigError::NoEnv { .. }), "{e}");
    }

    #[test]
    fn router_policy_goes_through_its_parser() {
        let (env, _) =
            router_env(&[("model", "m".into()), ("policy", "round-robin".into())]).unwrap();
        assert_eq!(env["CLEAVE_POLICY"], "round-robin");
        assert!(router_env(&[("model", "m".into()), ("policy", "best".into())]).is_err());
    }
}
