//! The agent's in-process suites over its HTTP interface, as one test binary.

mod common;

mod files;
mod filesystem;
mod process;
