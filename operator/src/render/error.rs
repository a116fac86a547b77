//! Why an InferenceService cannot be rendered: each variant names the field or step, and its
//! text is what the isvc's `Valid=False` condition says.

use super::config::ConfigError;

/// A spec the reconciler cannot turn into objects.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    /// The object came without `metadata.namespace`.
    #[error("InferenceService has no namespace")]
    NoNamespace,
    /// The object has no `metadata.uid` yet, so nothing can be owned by it.
    #[error("InferenceService has no uid yet")]
    NoUid,
    /// `model.source` sets none or several of its alternatives.
    #[error("model.source needs exactly one of path, url, image")]
    ModelSourceCount,
    /// `model.source.path.path` climbs out of the claim with `..`.
    #[error("model.source.path.path {0:?} leaves the claim")]
    PathLeavesClaim(String),
    /// A host path (no `claimName`) that is not absolute.
    #[error("model.source.path.path {0:?} must be absolute when no claimName is given")]
    RelativeHostPath(String),
    /// A pod's settings were refused by the binary's own flag parser.
    #[error("{component} settings")]
    Settings {
        /// `prefill`, `decode`, `router` or `endpoint-picker`.
        component: &'static str,
        /// What the parser said.
        #[source]
        source: ConfigError,
    },
    /// Rendering order: the gateway objects extend the router's Role.
    #[error("the router's Role must be rendered before the gateway objects")]
    NoRouterRole,
}

impl RenderError {
    /// Wraps a settings error of `component`.
    pub fn settings(component: &'static str) -> impl FnOnce(ConfigError) -> Self {
        move |source| Self::Settings { component, source }
    }
}
