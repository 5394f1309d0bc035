#![allow(clippy::disallowed_methods)]
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};

use proptest::prelude::*;

use super::*;

/// A tree root next to a sentinel directory that nothing done below the root may touch.
struct Setup {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    sentinel: PathBuf,
}

const MARKER: &[u8] = b"sentinel-content-7f3a";

fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    let sentinel = tmp.path().join("sentinel");
    std::fs::create_dir(&root).unwrap();
    std::fs::create_dir_all(sentinel.join("sub")).unwrap();
    std::fs::write(sentinel.join("secret"), MARKER).unwrap();
    std::fs::set_permissions(
        sentinel.join("secret"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    std::fs::write(sentinel.join("sub/file"), MARKER).unwrap();
    Setup {
        _tmp: tmp,
        root,
        sentinel,
    }
}

/// Everything observable about a host tree: per entry its kind, mode, owner, size, content
/// or link target.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, (u32, u32, u32, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(path) = pending.pop() {
        let meta = std::fs::symlink_metadata(&path).unwrap();
        let content = if meta.file_type().is_symlink() {
            std::fs::read_link(&path)
                .unwrap()
                .as_os_str()
                .as_bytes()
                .to_vec()
        } else if meta.is_file() {
            std::fs::read(&path).unwrap()
        } else {
            Vec::new()
        };
        out.insert(
            path.strip_prefix(dir).unwrap().to_owned(),
            (meta.mode(), meta.uid(), meta.gid(), content),
        );
        if meta.is_dir() {
            for entry in std::fs::read_dir(&path).unwrap() {
                pending.push(entry.unwrap().path());
            }
        }
    }
    out
}

#[test]
fn in_root_links_mean_what_they_mean_inside() {
    let s = setup();
    std::os::unix::fs::symlink("/", s.root.join("etc")).unwrap();
    std::os::unix::fs::symlink(&s.sentinel, s.root.join("host")).unwrap();
    let tree = Tree::open(&s.root, Links::InRoot).unwrap();
    tree.write("etc/new", b"x", 0o644).unwrap();
    assert_eq!(std::fs::read(s.root.join("new")).unwrap(), b"x");
    // The absolute host path of the sentinel, seen from inside, is a path below the root.
    assert!(tree.read("host/secret").unwrap_err().is_not_found());
    // Like `mkdir -p` in a chroot: the dangling link is not replaced, and nothing is made.
    // `mkdir` finds the link in the way, and opening it leads nowhere inside the root.
    let err = tree.create_dir_all("host/sub", 0o755).err();
    assert!(
        matches!(&err, Some(FsError::NotFound(path)) if path == "host"),
        "{err:?}"
    );
    assert!(!s.sentinel.join("sub/sub").exists());
    assert_eq!(std::fs::read(s.sentinel.join("secret")).unwrap(), MARKER);
}

#[test]
fn refused_links_stop_every_path_through_them() {
    let s = setup();
    std::fs::create_dir(s.root.join("d")).unwrap();
    std::os::unix::fs::symlink(&s.sentinel, s.root.join("l")).unwrap();
    std::os::unix::fs::symlink("d", s.root.join("inner")).unwrap();
    let tree = Tree::open(&s.root, Links::Refused).unwrap();
    assert!(matches!(tree.read("l/secret"), Err(FsError::Link(_))));
    assert!(matches!(
        tree.write("l/new", b"x", 0o644),
        Err(FsError::Link(_))
    ));
    // Even a link that stays inside is not followed.
    assert!(matches!(tree.read_dir("inner"), Err(FsError::Link(_))));
    // The link itself is data.
    assert_eq!(tree.read_link("l").unwrap(), s.sentinel);
    assert_eq!(
        Kind::of(&tree.symlink_metadata("l").unwrap().unwrap()),
        Kind::Symlink
    );
    assert!(!s.sentinel.join("new").exists());
}

#[test]
fn beneath_follows_links_that_stay_and_refuses_ones_that_leave() {
    let s = setup();
    std::fs::create_dir(s.root.join("d")).unwrap();
    std::fs::write(s.root.join("d/f"), b"in").unwrap();
    std::os::unix::fs::symlink("d", s.root.join("ok")).unwrap();
    std::os::unix::fs::symlink("../sentinel", s.root.join("up")).unwrap();
    let tree = Tree::open(&s.root, Links::Beneath).unwrap();
    assert_eq!(tree.read("ok/f").unwrap(), b"in");
    assert!(matches!(tree.read("up/secret"), Err(FsError::Escapes(_))));
    assert!(matches!(
        tree.read("../sentinel/secret"),
        Err(FsError::Escapes(_))
    ));
}

#[test]
fn last_components_are_never_followed_by_changes() {
    let s = setup();
    let secret = s.sentinel.join("secret");
    std::os::unix::fs::symlink(&secret, s.root.join("f")).unwrap();
    for links in [Links::InRoot, Links::Beneath, Links::Refused] {
        let tree = Tree::open(&s.root, links).unwrap();
        assert!(matches!(tree.chmod("f", 0o4755), Err(FsError::Link(_))));
        assert!(matches!(
            tree.create_file("f", 0o644),
            Err(FsError::Link(_))
        ));
        tree.chown("f", 0, 0).unwrap();
    }
    let tree = Tree::open(&s.root, Links::InRoot).unwrap();
    tree.remove("f").unwrap();
    assert_eq!(
        std::fs::metadata(&secret).unwrap().mode() & 0o7777,
        0o600,
        "the link's target kept its mode"
    );
    assert_eq!(std::fs::read(&secret).unwrap(), MARKER);
}

#[test]
fn remove_all_never_follows_links_and_handles_deep_trees() {
    let s = setup();
    let mut deep = s.root.join("t");
    for _ in 0..300 {
        deep.push("d");
    }
    std::fs::create_dir_all(&deep).unwrap();
    std::os::unix::fs::symlink(&s.sentinel, deep.join("host")).unwrap();
    std::os::unix::fs::symlink(&s.sentinel, s.root.join("t/host")).unwrap();
    let tree = Tree::open(&s.root, Links::Refused).unwrap();
    tree.remove_all("t").unwrap();
    assert!(!s.root.join("t").exists());
    assert_eq!(std::fs::read(s.sentinel.join("sub/file")).unwrap(), MARKER);
    tree.remove_all("missing").unwrap();
}

/// Records what a walk visits, and optionally moves a directory when it meets a path.
struct Recorder {
    seen: Vec<String>,
    move_at: Option<(PathBuf, PathBuf, PathBuf)>,
}

impl Visitor for Recorder {
    type Error = FsError;

    fn enter(&mut self, _dir: &Dir, path: &Path) -> Result<()> {
        self.seen.push(format!("{}/", path.display()));
        Ok(())
    }

    fn entry(&mut self, _parent: &Dir, entry: &Entry, path: &Path) -> Result<bool> {
        if let Some((at, from, to)) = &self.move_at
            && at == path
        {
            std::fs::rename(from, to).unwrap();
        }
        if entry.kind != Kind::Dir {
            self.seen.push(path.display().to_string());
        }
        Ok(!entry.name.as_bytes().starts_with(b"skip"))
    }
}

/// Every path below `dir` in the order a depth-first walk by sorted names meets them.
fn reference_walk(dir: &Path, shown: &Path, out: &mut Vec<String>) {
    out.push(format!("{}/", shown.display()));
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    for name in names {
        let path = dir.join(&name);
        let child = shown.join(&name);
        if name.as_bytes().starts_with(b"skip") {
            continue;
        }
        if std::fs::symlink_metadata(&path).unwrap().is_dir() {
            reference_walk(&path, &child, out);
        } else {
            out.push(child.display().to_string());
        }
    }
}

#[test]
fn a_walk_deeper_than_its_open_directories_meets_everything_in_order() {
    let s = setup();
    let depth = WALK_OPEN_DIRS * 3;
    let mut deep = s.root.clone();
    for level in 0..depth {
        deep.push("d");
        std::fs::create_dir(&deep).unwrap();
        std::fs::write(deep.with_file_name(format!("f{level}")), b"x").unwrap();
    }
    for wide in 0..50 {
        std::fs::create_dir_all(s.root.join(format!("w{wide:02}")).join("inner")).unwrap();
    }
    std::fs::create_dir_all(s.root.join("skipped").join("below")).unwrap();
    std::os::unix::fs::symlink(&s.sentinel, s.root.join("link")).unwrap();

    let mut recorder = Recorder {
        seen: Vec::new(),
        move_at: None,
    };
    walk(Dir::open_host(&s.root).unwrap(), &mut recorder).unwrap();
    let mut expected = Vec::new();
    reference_walk(&s.root, Path::new(""), &mut expected);
    assert_eq!(recorder.seen, expected);
    assert!(recorder.seen.contains(&"link".to_owned()));
    assert!(!recorder.seen.iter().any(|p| p.contains("below")));
}

#[test]
fn a_directory_moved_under_a_walk_stops_it() {
    let s = setup();
    let depth = WALK_OPEN_DIRS * 2;
    let mut deep = s.root.clone();
    for _ in 0..depth {
        deep.push("d");
        std::fs::create_dir(&deep).unwrap();
    }
    std::fs::write(deep.join("leaf"), b"x").unwrap();
    // At the leaf, the shallowest directory still open moves to the top: coming back up, its
    // `..` is no longer the directory the walk let go of.
    let shallowest_open = depth + 1 - WALK_OPEN_DIRS;
    let moved: PathBuf = std::iter::repeat_n("d", shallowest_open).collect();
    let mut recorder = Recorder {
        seen: Vec::new(),
        move_at: Some((
            std::iter::repeat_n("d", depth)
                .collect::<PathBuf>()
                .join("leaf"),
            s.root.join(&moved),
            s.root.join("elsewhere"),
        )),
    };
    let err = walk(Dir::open_host(&s.root).unwrap(), &mut recorder).unwrap_err();
    let parent: PathBuf = std::iter::repeat_n("d", shallowest_open - 1).collect();
    assert!(
        matches!(&err, FsError::Moved(path) if Path::new(path) == parent),
        "{err}"
    );
}

#[test]
fn remove_all_never_enters_a_mount() {
    // A mount namespace of this test thread's own, private, so nothing reaches the host.
    // SAFETY: only the mount namespace (and this thread's fs context) is unshared.
    if unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNS) }.is_err()
        || rustix::mount::mount_change(
            "/",
            rustix::mount::MountPropagationFlags::PRIVATE
                | rustix::mount::MountPropagationFlags::REC,
        )
        .is_err()
    {
        eprintln!("skipped: needs root for a private mount namespace");
        return;
    }
    let s = setup();
    std::fs::create_dir_all(s.root.join("t/a/mnt")).unwrap();
    std::fs::create_dir_all(s.root.join("t/a/b")).unwrap();
    std::fs::create_dir_all(s.root.join("t/m")).unwrap();
    std::fs::write(s.root.join("t/a/b/f"), b"x").unwrap();
    for at in ["t/a/mnt", "t/m"] {
        rustix::mount::mount(
            "test",
            s.root.join(at),
            "tmpfs",
            rustix::mount::MountFlags::empty(),
            None,
        )
        .unwrap();
        std::fs::write(s.root.join(at).join("inside"), MARKER).unwrap();
    }
    let tree = Tree::open(&s.root, Links::Refused).unwrap();
    let err = tree.remove_all("t").unwrap_err();
    assert!(matches!(err, FsError::MountPoints(_, 2)), "{err}");
    assert_eq!(
        std::fs::read(s.root.join("t/a/mnt/inside")).unwrap(),
        MARKER
    );
    assert_eq!(std::fs::read(s.root.join("t/m/inside")).unwrap(), MARKER);
    assert!(!s.root.join("t/a/b").exists());
    let err = tree
        .root()
        .unwrap()
        .remove_all(std::ffi::OsStr::new("t"))
        .unwrap_err();
    assert!(matches!(err, FsError::MountPoints(_, 2)), "{err}");
    for at in ["t/a/mnt", "t/m"] {
        rustix::mount::unmount(s.root.join(at), rustix::mount::UnmountFlags::DETACH).unwrap();
    }
    tree.remove_all("t").unwrap();
    assert!(!s.root.join("t").exists());
}

#[test]
fn new_entries_get_exactly_the_mode_asked() {
    let s = setup();
    let tree = Tree::open(&s.root, Links::Refused).unwrap();
    tree.create_dir("d", 0o1777).unwrap();
    tree.write("d/f", b"x", 0o4755).unwrap();
    assert_eq!(
        std::fs::metadata(s.root.join("d")).unwrap().mode() & 0o7777,
        0o1777
    );
    assert_eq!(
        std::fs::metadata(s.root.join("d/f")).unwrap().mode() & 0o7777,
        0o4755
    );
}

#[test]
fn special_files_are_not_opened() {
    let s = setup();
    let fifo = std::ffi::CString::new(s.root.join("p").as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid nul-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
    let tree = Tree::open(&s.root, Links::Refused).unwrap();
    // Opening a FIFO for reading would block; it is refused before any open.
    assert!(matches!(tree.read("p"), Err(FsError::NotAFile(_))));
    assert!(matches!(
        tree.create_file("p", 0o644),
        Err(FsError::NotAFile(_))
    ));
}

// ---- property test: random trees, random operations, the sentinel never moves ----

const NAMES: &[&str] = &["a", "b", "c", "..", "."];

fn rel_path() -> impl Strategy<Value = String> {
    (
        prop::bool::ANY,
        prop::collection::vec(prop::sample::select(NAMES), 1..4),
    )
        .prop_map(|(absolute, parts)| {
            let joined = parts.join("/");
            if absolute {
                format!("/{joined}")
            } else {
                joined
            }
        })
}

#[derive(Debug, Clone)]
enum Target {
    Relative(String),
    Sentinel(&'static str),
    Absolute(String),
}

fn target() -> impl Strategy<Value = Target> {
    prop_oneof![
        rel_path().prop_map(Target::Relative),
        prop::sample::select(vec!["", "secret", "sub", "sub/file"]).prop_map(Target::Sentinel),
        rel_path().prop_map(|p| Target::Absolute(format!("/{}", p.trim_start_matches('/')))),
        Just(Target::Relative("../sentinel".into())),
        Just(Target::Relative("../../../../..".into())),
    ]
}

#[derive(Debug, Clone)]
enum Op {
    Dir(String),
    DirAll(String),
    Write(String),
    Link(Target, String),
    HardLink(String, String),
    Remove(String),
    RemoveAll(String),
    Rename(String, String),
    Chown(String),
    Chmod(String),
    Read(String),
    List(String),
    Stat(String),
    ReadLink(String),
    Walk(String),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        rel_path().prop_map(Op::Dir),
        rel_path().prop_map(Op::DirAll),
        rel_path().prop_map(Op::Write),
        (target(), rel_path()).prop_map(|(t, p)| Op::Link(t, p)),
        (rel_path(), rel_path()).prop_map(|(a, b)| Op::HardLink(a, b)),
        rel_path().prop_map(Op::Remove),
        rel_path().prop_map(Op::RemoveAll),
        (rel_path(), rel_path()).prop_map(|(a, b)| Op::Rename(a, b)),
        rel_path().prop_map(Op::Chown),
        rel_path().prop_map(Op::Chmod),
        rel_path().prop_map(Op::Read),
        rel_path().prop_map(Op::List),
        rel_path().prop_map(Op::Stat),
        rel_path().prop_map(Op::ReadLink),
        rel_path().prop_map(Op::Walk),
    ]
}

fn links() -> impl Strategy<Value = Links> {
    prop::sample::select(vec![Links::InRoot, Links::Beneath, Links::Refused])
}

/// Copies a subtree through `Dir` handles only (as a COPY step does), into `to`.
fn walk_copy(tree: &Tree, from: &str, to: &str) -> Result<()> {
    let source = tree.dir(from)?;
    let target = tree.create_dir_all(to, 0o755)?;
    let mut pending = vec![(source, target, 0)];
    while let Some((src, dst, depth)) = pending.pop() {
        if depth > 3 {
            continue;
        }
        for entry in src.entries()? {
            match entry.kind {
                Kind::Dir => {
                    let s = src.open_dir(&entry.name)?;
                    let d = dst.ensure_dir(&entry.name, 0o755)?;
                    pending.push((s, d, depth + 1));
                }
                Kind::File => {
                    let mut input = src.open_file(&entry.name)?;
                    dst.clear_for(&entry.name)?;
                    let mut output = dst.create_file(&entry.name, 0o644, true)?;
                    std::io::copy(&mut input, &mut output).unwrap();
                }
                Kind::Symlink => {
                    let t = src.read_link(&entry.name)?;
                    dst.clear_for(&entry.name)?;
                    dst.symlink(&t, &entry.name)?;
                }
                Kind::Other => {}
            }
        }
    }
    Ok(())
}

fn apply(tree: &Tree, op: &Op, sentinel: &Path) {
    let never_sentinel = |data: &[u8]| {
        assert!(
            !data.windows(MARKER.len()).any(|w| w == MARKER),
            "{op:?} read the sentinel"
        );
    };
    match op {
        Op::Dir(p) => drop(tree.create_dir(p, 0o755)),
        Op::DirAll(p) => drop(tree.create_dir_all(p, 0o700)),
        Op::Write(p) => drop(tree.write(p, b"tenant", 0o4755)),
        Op::Link(target, p) => {
            let t = match target {
                Target::Relative(r) | Target::Absolute(r) => PathBuf::from(r),
                Target::Sentinel(s) => sentinel.join(s),
            };
            drop(tree.symlink(t, p));
        }
        Op::HardLink(a, b) => drop(tree.hard_link(a, b)),
        Op::Remove(p) => drop(tree.remove(p)),
        Op::RemoveAll(p) => drop(tree.remove_all(p)),
        Op::Rename(a, b) => drop(tree.rename(a, b)),
        Op::Chown(p) => drop(tree.chown(p, 12345, 12345)),
        Op::Chmod(p) => drop(tree.chmod(p, 0o4777)),
        Op::Read(p) => {
            if let Ok(data) = tree.read(p) {
                never_sentinel(&data);
            }
        }
        Op::List(p) => {
            if let Ok(entries) = tree.read_dir(p) {
                assert!(
                    !entries.iter().any(|e| e.name == "secret"),
                    "{op:?} listed the sentinel"
                );
            }
        }
        Op::Stat(p) => {
            drop(tree.symlink_metadata(p));
            drop(tree.metadata(p));
        }
        Op::ReadLink(p) => drop(tree.read_link(p)),
        Op::Walk(p) => drop(walk_copy(tree, p, "copied")),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn nothing_outside_the_root_is_read_written_removed_or_repermissioned(
        setup_ops in prop::collection::vec(op(), 0..12),
        ops in prop::collection::vec((links(), op()), 1..24),
    ) {
        let s = setup();
        let before = snapshot(&s.sentinel);
        // The tree is first laid out freely (links to anywhere), as a tenant would.
        let builder = Tree::open(&s.root, Links::Refused).unwrap();
        for op in &setup_ops {
            apply(&builder, op, &s.sentinel);
        }
        for (links, op) in &ops {
            let tree = Tree::open(&s.root, *links).unwrap();
            apply(&tree, op, &s.sentinel);
        }
        prop_assert_eq!(before, snapshot(&s.sentinel));
        prop_assert!(s.root.is_dir());
    }
}
