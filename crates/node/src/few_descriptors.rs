//! Runs a test's body in a child process (the test binary again, filtered to that test) whose
//! limit of open descriptors is low, so a walk that keeps one descriptor per directory fails
//! there instead of passing on a generous limit.

#![allow(clippy::unwrap_used, clippy::disallowed_methods)]

use std::path::{Path, PathBuf};

const CHILD: &str = "SANDBAR_TEST_FEW_DESCRIPTORS";

/// The descriptors the child may hold: the test harness's own, the tree's walk and the
/// output, with room to spare, and far fewer than the tree has directories.
pub(crate) const LIMIT: u64 = 64;

/// A tree with more directories in one directory, and nested deeper, than [`LIMIT`]; returns
/// the path, within `root`, of the file at the bottom of its deepest directory.
fn crowded_tree(root: &Path) -> PathBuf {
    for wide in 0..400 {
        let dir = root.join(format!("wide{wide:03}"));
        std::fs::create_dir_all(dir.join("inner")).unwrap();
        std::fs::write(dir.join("file"), b"w").unwrap();
    }
    let mut deep = PathBuf::from("deep");
    for _ in 0..200 {
        deep.push("d");
    }
    std::fs::create_dir_all(root.join(&deep)).unwrap();
    let leaf = deep.join("leaf");
    std::fs::write(root.join(&leaf), b"leaf").unwrap();
    leaf
}

/// In the parent: runs `test` (`module_path!()` and the test's name) again in a child and
/// asserts it passed. In the child: lowers the limit, makes a crowded tree in a temporary
/// directory and runs `body` on it, with the tree's root and its deepest file.
pub(crate) fn run_on_crowded_tree(test: &str, body: impl FnOnce(&Path, &Path)) {
    // Test names leave out the crate's.
    let test = test.split_once("::").map_or(test, |(_, name)| name);
    if std::env::var_os(CHILD).is_some() {
        let limit = libc::rlimit {
            rlim_cur: LIMIT,
            rlim_max: LIMIT,
        };
        // SAFETY: setrlimit reads the struct, which lives for the call.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) }, 0);
        let tmp = tempfile::tempdir().unwrap();
        let leaf = crowded_tree(tmp.path());
        body(tmp.path(), &leaf);
        return;
    }
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "{text}");
    assert!(text.contains("1 passed"), "the child ran no test: {text}");
}
