//! The image crate's suites against a real registry on 127.0.0.1, as one test binary.

mod common;

mod blobs;
mod pull;
