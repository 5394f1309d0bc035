//! What a host can give sandboxes: cgroups per sandbox, memory and task admission.

pub mod cgroups;
pub mod io;
pub mod memory;
pub mod tasks;
