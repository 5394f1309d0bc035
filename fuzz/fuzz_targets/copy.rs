//! A COPY step over any lower layer, from any build context, with any source and
//! destination: nothing outside the new layer changes, and nothing of the sentinel (reached
//! by links in the context or the layer) lands in it.

#![no_main]

#[path = "common.rs"]
mod common;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (Vec<common::Entry>, Vec<common::Entry>, common::Name, common::Name, bool)| {
    let (layer, context, src, dest, prerequisites) = input;
    let scratch = common::Scratch::new();
    let before = common::snapshot(&scratch.sentinel);
    let lower = scratch.dir("lower");
    let ctx = scratch.dir("ctx");
    let upper = scratch.dir("upper");
    let _ = sandbar_image::apply_layer(
        std::io::Cursor::new(common::tar_of(&layer, &scratch.sentinel)),
        &lower,
    );
    let _ = sandbar_image::extract_upload(
        std::io::Cursor::new(common::tar_of(&context, &scratch.sentinel)),
        &ctx,
    );
    let lower = [lower];
    if prerequisites {
        let _ = sandbar_node::builder::prerequisites_step(&lower, &upper);
    }
    let _ = sandbar_node::builder::copy_step(
        &lower,
        &upper,
        &ctx,
        &src.render(),
        &format!("/{}", dest.render()),
        (0, 0),
        Some(0o4755),
    );
    assert_eq!(before, common::snapshot(&scratch.sentinel));
    common::assert_no_sentinel_content(&upper);
});
