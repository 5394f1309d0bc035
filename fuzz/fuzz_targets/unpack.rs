//! Any archive, unpacked as a build context or an image layer: nothing outside the target
//! directory changes, and nothing of the sentinel is copied in.

#![no_main]

#[path = "common.rs"]
mod common;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (Vec<common::Entry>, bool)| {
    let (entries, as_layer) = input;
    let scratch = common::Scratch::new();
    let before = common::snapshot(&scratch.sentinel);
    let target = scratch.dir("target");
    let archive = common::tar_of(&entries, &scratch.sentinel);
    let reader = std::io::Cursor::new(archive);
    if as_layer {
        let _ = sandbar_image::apply_layer(reader, &target);
    } else {
        let _ = sandbar_image::extract_upload(reader, &target);
    }
    assert_eq!(before, common::snapshot(&scratch.sentinel));
    common::assert_no_sentinel_content(&target);
});
