//! Container images for sandboxes: pulling from OCI and Docker registries into a
//! content-addressed cache, and unpacking tar archives (image layers and user uploads) safely.
//!
//! Every unpacked layer is a directory laid out as an overlayfs lower layer mounted with
//! `userxattr`: deletions are character devices 0:0 and opaque directories carry
//! `user.overlay.opaque=y`, so a stack of layers can be handed to overlayfs as they are.

pub mod registry;
pub mod unpack;

pub use registry::{ImageCache, ImageConfig, PullError, PulledImage, PulledLayer, RegistryAuth};
pub use unpack::{UnpackError, UnpackStats, apply_layer, extract_upload};
