//! What sandboxes and templates keep on disk: the btrfs disk pool, template and image layers, layer archives, volumes, build-context uploads, and the server's own mounts.

pub mod disks;
pub mod image_layers;
pub mod layer_archive;
pub mod layers;
pub mod mounts;
pub mod uploads;
pub mod volumes;
