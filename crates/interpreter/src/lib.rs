//! The code interpreter server of the `code-interpreter-v1` template: E2B's execution API
//! (port 49999) served over Jupyter kernels started and spoken to directly, without a
//! Jupyter server.

pub mod kernel;
pub mod output;
pub mod sandbox_env;
pub mod server;

pub use kernel::KernelCommand;
pub use server::{Config, Server};
