//! The `troupe` command line (DESIGN.md, "Command line"): JSON to stdout, logs to stderr.

pub mod adapters;
pub mod code;
pub mod env;
pub mod eval;
pub mod model;
pub mod plot;
pub mod train;
