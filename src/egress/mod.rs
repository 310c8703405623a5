//! Egress for the allowlist tier: the entry grammar and built-in list, and
//! the per-run HTTP proxy.

pub mod allowlist;
pub mod proxy;
