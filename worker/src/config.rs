//! One typed configuration for both worker roles: defined in [`cleave_config::worker`] (the
//! operator renders it without linking the worker).

pub use cleave_config::worker::*;
