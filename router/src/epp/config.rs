//! The endpoint picker's settings (`cleave-router --mode endpoint-picker`), defined in
//! [`cleave_config::epp`] and flattened into [`crate::config::RouterConfig`].

pub use cleave_config::epp::EppConfig;
