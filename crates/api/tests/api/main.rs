//! The API crate's in-process suites: a real SQLite store and router with one runtime double
//! (`common`). One test binary rather than one per suite: each would link the whole server.

mod common;

mod caps;
mod cluster;
mod keys;
mod lifecycle_races;
mod logs;
mod metrics;
mod network;
mod openapi;
mod pause_races;
mod rest;
mod volumes;
