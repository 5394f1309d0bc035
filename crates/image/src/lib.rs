//! Container images for sandboxes: pulling from OCI and Docker registries into a
//! content-addressed cache, and unpacking tar archives (image layers and user uploads) safely.
//!
//! Every unpacked layer is a directory laid out as an overlayfs lower layer mounted with
//! `userxattr`: deletions are character devices 0:0 and opaque directories carry
//! `user.overlay.opaque=y`, so a stack of layers can be handed to overlayfs as they are.
//!
//! Pulls contact only registries the [`RegistryPolicy`] allows: never the host itself, its
//! link-local neighbours or the sandbox network, unless the operator said so.

pub mod blob_store;
mod distribution;
mod pull_error;
pub mod registry;
pub mod registry_address;
#[cfg(test)]
mod test_server;
pub mod unpack;

pub use blob_store::{BlobStore, BlobStoreError};
pub use registry::{ImageCache, ImageConfig, PullError, PulledImage, PulledLayer, RegistryAuth};
pub use registry_address::{
    AllowedRegistry, AllowedRegistryError, RefusedRange, RegistryPolicy, RegistryRefused,
};
pub use unpack::{
    ByteBudget, ENTRY_COST, UnpackError, UnpackStats, apply_layer, apply_layer_within,
    extract_upload, extract_upload_within,
};
