//! Template builds on this node: the builder and its steps, their bounded output, and the built-in templates' roots (`base`, the code interpreter, the desktop) and the files they are given.

pub(crate) mod build_output;
pub(crate) mod build_step;
pub mod builder;
pub mod builtin_files;
pub mod desktop;
pub mod interpreter;
pub mod templates;
