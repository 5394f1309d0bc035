//! Pulls from a real registry (`docker-registry` from the distribution project) on 127.0.0.1,
//! filled with `skopeo` from OCI layouts built here. Skipped, with a note on stderr, where
//! those programs or a static busybox are missing.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::io::Write as _;
use std::net::TcpListener;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use common::{DOCKER_REGISTRY, HTPASSWD, Registry, SKOPEO, have_all, registry_with_user};
use sandbar_image::{ImageCache, PullError, PulledImage, RegistryAuth, RegistryPolicy};
use serde_json::json;
use sha2::{Digest, Sha256};

const BUSYBOX: &str = "/bin/busybox";

fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

fn foreign_arch() -> &'static str {
    if host_arch() == "s390x" {
        "riscv64"
    } else {
        "s390x"
    }
}

/// The test registries listen on loopback, which pulls may reach only when allowed.
fn loopback_allowed() -> std::sync::Arc<RegistryPolicy> {
    std::sync::Arc::new(
        RegistryPolicy::new(vec!["127.0.0.1".parse().unwrap()], vec![], vec![]).unwrap(),
    )
}

fn sha256(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// An OCI image layout on disk, as skopeo reads it.
struct Layout {
    dir: PathBuf,
    tags: Vec<serde_json::Value>,
}

impl Layout {
    fn new(dir: PathBuf) -> Layout {
        std::fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
        std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        Layout {
            dir,
            tags: Vec::new(),
        }
    }

    fn blob(&self, media_type: &str, data: &[u8]) -> serde_json::Value {
        let digest = sha256(data);
        let hex = digest.strip_prefix("sha256:").unwrap();
        std::fs::write(self.dir.join("blobs/sha256").join(hex), data).unwrap();
        json!({ "mediaType": media_type, "digest": digest, "size": data.len() })
    }

    /// Stores an image manifest; `layers` are (blob, media type, diff id).
    fn image(&self, arch: &str, layers: &[&(Vec<u8>, &str, String)]) -> serde_json::Value {
        let config = json!({
            "architecture": arch,
            "os": "linux",
            "config": {
                "Env": ["PATH=/bin", "FOO=bar"],
                "User": "1000:1000",
                "WorkingDir": "/data",
                "Entrypoint": ["/bin/sh", "-c"],
                "Cmd": ["echo hi"],
            },
            "rootfs": {
                "type": "layers",
                "diff_ids": layers.iter().map(|l| l.2.clone()).collect::<Vec<_>>(),
            },
        });
        let config = self.blob(
            "application/vnd.oci.image.config.v1+json",
            config.to_string().as_bytes(),
        );
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": config,
            "layers": layers.iter().map(|l| self.blob(l.1, &l.0)).collect::<Vec<_>>(),
        });
        self.blob(
            "application/vnd.oci.image.manifest.v1+json",
            manifest.to_string().as_bytes(),
        )
    }

    fn index(&self, manifests: Vec<(serde_json::Value, &str)>) -> serde_json::Value {
        let manifests: Vec<_> = manifests
            .into_iter()
            .map(|(mut descriptor, arch)| {
                descriptor["platform"] = json!({ "architecture": arch, "os": "linux" });
                descriptor
            })
            .collect();
        let index = json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": manifests,
        });
        self.blob(
            "application/vnd.oci.image.index.v1+json",
            index.to_string().as_bytes(),
        )
    }

    fn tag(&mut self, mut descriptor: serde_json::Value, tag: &str) {
        descriptor["annotations"] = json!({ "org.opencontainers.image.ref.name": tag });
        self.tags.push(descriptor);
        let index = json!({ "schemaVersion": 2, "manifests": self.tags });
        std::fs::write(self.dir.join("index.json"), index.to_string()).unwrap();
    }

    fn push(&self, tag: &str, registry: &Registry, all: bool) {
        self.push_as(tag, registry, all, None);
    }

    fn push_as(&self, tag: &str, registry: &Registry, all: bool, creds: Option<&str>) {
        let mut command = Command::new("skopeo");
        command.args([
            "--insecure-policy",
            "copy",
            "--quiet",
            "--dest-tls-verify=false",
        ]);
        if let Some(creds) = creds {
            command.arg(format!("--dest-creds={creds}"));
        }
        if all {
            command.arg("--all");
        }
        let status = command
            .arg(format!("oci:{}:{tag}", self.dir.display()))
            .arg(format!("docker://{}/tiny:{tag}", registry.host()))
            .status()
            .unwrap();
        assert!(status.success(), "skopeo copy {tag}");
    }
}

fn header(kind: tar::EntryType, mode: u32, size: usize) -> tar::Header {
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(kind);
    header.set_mode(mode);
    header.set_size(size as u64);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(1_700_000_000);
    header
}

/// Builds a layer tar; returns it with its diff id.
fn layer(build: impl FnOnce(&mut tar::Builder<Vec<u8>>)) -> (Vec<u8>, String) {
    let mut builder = tar::Builder::new(Vec::new());
    build(&mut builder);
    let tar = builder.into_inner().unwrap();
    let diff_id = sha256(&tar);
    (tar, diff_id)
}

fn add_dir(b: &mut tar::Builder<Vec<u8>>, name: &str) {
    let mut h = header(tar::EntryType::Directory, 0o755, 0);
    b.append_data(&mut h, name, std::io::empty()).unwrap();
}

fn add_file(b: &mut tar::Builder<Vec<u8>>, name: &str, mode: u32, data: &[u8]) {
    let mut h = header(tar::EntryType::Regular, mode, data.len());
    b.append_data(&mut h, name, data).unwrap();
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(data).unwrap();
    gz.finish().unwrap()
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Collects progress lines.
#[derive(Default)]
struct Progress(Mutex<Vec<String>>);

impl Progress {
    fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

async fn pull(
    cache: &ImageCache,
    reference: &str,
) -> (Result<PulledImage, PullError>, Vec<String>) {
    let progress = Progress::default();
    let result = cache
        .pull(reference, None, &|line| {
            progress.0.lock().unwrap().push(line)
        })
        .await;
    (result, progress.lines())
}

/// [`pull`] on behalf of `owner`, within 1 GiB.
async fn pull_as(
    cache: &ImageCache,
    owner: &str,
    reference: &str,
) -> (Result<PulledImage, PullError>, Vec<String>) {
    let progress = Progress::default();
    let result = cache
        .pull_for(
            owner,
            reference,
            None,
            &|line| progress.0.lock().unwrap().push(line),
            1 << 30,
        )
        .await;
    (result, progress.lines())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_from_a_local_registry() {
    if !have_all(&[DOCKER_REGISTRY, SKOPEO]) {
        return;
    }
    if !Path::new(BUSYBOX).is_file() {
        eprintln!("skipping: needs {BUSYBOX} (apt-get install busybox-static)");
        return;
    }

    let tmp = tempfile::tempdir().unwrap();
    let registry = Registry::start(tmp.path(), None);
    let host = registry.host();

    // Layer 1: a busybox root with a file to delete and a directory to replace.
    let busybox = std::fs::read(BUSYBOX).unwrap();
    let (base, base_id) = layer(|b| {
        add_dir(b, "bin/");
        add_file(b, "bin/busybox", 0o755, &busybox);
        let mut h = header(tar::EntryType::Symlink, 0o777, 0);
        b.append_link(&mut h, "bin/sh", "busybox").unwrap();
        add_dir(b, "etc/");
        add_file(b, "etc/greeting", 0o644, b"hello\n");
        add_file(b, "to-delete", 0o644, b"bye\n");
        add_dir(b, "data/");
        add_file(b, "data/old1", 0o644, b"1");
        add_file(b, "data/old2", 0o644, b"2");
    });
    // Layer 2: deletes a file and replaces the contents of a directory.
    let (top, top_id) = layer(|b| {
        add_file(b, ".wh.to-delete", 0o644, b"");
        add_dir(b, "data/");
        add_file(b, "data/.wh..wh..opq", 0o644, b"");
        add_file(b, "data/new", 0o644, b"new\n");
        add_file(b, "etc/greeting", 0o644, b"hello again\n");
    });
    let (odd, _) = layer(|b| add_file(b, "odd", 0o644, b"odd one\n"));
    let (broken, broken_id) = layer(|b| add_file(b, "broken", 0o644, b"broken\n"));

    let gz = "application/vnd.oci.image.layer.v1.tar+gzip";
    let zst = "application/vnd.oci.image.layer.v1.tar+zstd";
    let base_layer = (gzip(&base), gz, base_id.clone());
    let top_layer = (
        zstd::encode_all(top.as_slice(), 3).unwrap(),
        zst,
        top_id.clone(),
    );
    let wrong_diff = (gzip(&odd), gz, format!("sha256:{}", "e".repeat(64)));
    let corrupt = (gzip(&broken), gz, broken_id);
    // Claims the private base layer's diff id without having its contents.
    let forged = (gzip(&odd), gz, base_id.clone());

    let mut oci = Layout::new(tmp.path().join("layout"));
    let tiny = oci.image(host_arch(), &[&base_layer, &top_layer]);
    let foreign = oci.image(foreign_arch(), &[&base_layer]);
    oci.tag(tiny.clone(), "1");
    oci.tag(
        oci.index(vec![
            (foreign.clone(), foreign_arch()),
            (tiny.clone(), host_arch()),
        ]),
        "multi",
    );
    oci.tag(
        oci.index(vec![(foreign.clone(), foreign_arch())]),
        "foreign",
    );
    oci.tag(
        oci.image(host_arch(), &[&base_layer, &wrong_diff]),
        "wrong-diff",
    );
    oci.tag(oci.image(host_arch(), &[&corrupt]), "corrupt");
    oci.tag(oci.image(host_arch(), &[&forged]), "forged");
    for (tag, all) in [
        ("forged", false),
        ("1", false),
        ("multi", true),
        ("foreign", true),
        ("wrong-diff", false),
        ("corrupt", false),
    ] {
        oci.push(tag, &registry, all);
    }
    // The registry hands out what it stores without checking it again.
    let corrupt_blob = registry.blob_file(&sha256(&corrupt.0));
    let mut garbage = std::fs::read(&corrupt_blob).unwrap();
    garbage.iter_mut().rev().take(8).for_each(|b| *b ^= 0xff);
    std::fs::write(&corrupt_blob, garbage).unwrap();

    let cache_dir = tmp.path().join("cache");
    let cache = ImageCache::new(cache_dir.clone(), loopback_allowed());
    let reference = format!("{host}/tiny:1");
    let (image, progress) = pull(&cache, &reference).await;
    let image = image.unwrap();
    assert_eq!(image.reference, reference);
    assert!(image.manifest_digest.starts_with("sha256:"));
    assert_eq!(
        image
            .layers
            .iter()
            .map(|l| l.diff_id.as_str())
            .collect::<Vec<_>>(),
        [base_id.as_str(), top_id.as_str()]
    );
    let layers_dir = cache.layers_dir();
    for layer in &image.layers {
        assert_eq!(layer.path, layers_dir.join(&layer.diff_id[7..]));
    }
    assert_eq!(
        progress
            .iter()
            .filter(|l| l.starts_with("pulling layer sha256:"))
            .count(),
        2,
        "{progress:?}"
    );
    assert!(progress.iter().any(|l| l.contains("MB)")), "{progress:?}");

    let (lower, upper) = (&image.layers[0].path, &image.layers[1].path);
    let busybox_meta = std::fs::metadata(lower.join("bin/busybox")).unwrap();
    assert_eq!(
        (busybox_meta.len(), busybox_meta.mode() & 0o7777),
        (busybox.len() as u64, 0o755)
    );
    assert_eq!(
        std::fs::read_link(lower.join("bin/sh")).unwrap(),
        Path::new("busybox")
    );
    let whiteout = std::fs::symlink_metadata(upper.join("to-delete")).unwrap();
    assert!(whiteout.file_type().is_char_device());
    assert_eq!(whiteout.rdev(), 0);
    let mut opaque = [0u8; 4];
    let n = rustix::fs::getxattr(upper.join("data"), "user.overlay.opaque", &mut opaque).unwrap();
    assert_eq!(&opaque[..n], b"y");
    assert_eq!(names(&upper.join("data")), ["new"]);

    let config = &image.config;
    assert_eq!(
        config.env,
        [("PATH".into(), "/bin".into()), ("FOO".into(), "bar".into())]
    );
    assert_eq!(config.user.as_deref(), Some("1000:1000"));
    assert_eq!(config.workdir.as_deref(), Some("/data"));
    assert_eq!(config.entrypoint, ["/bin/sh", "-c"]);
    assert_eq!(config.cmd, ["echo hi"]);

    check_overlay(tmp.path(), &image);

    // Everything is cached now: the second pull downloads no layer.
    let (again, progress) = pull(&cache, &reference).await;
    assert_eq!(again.unwrap(), image);
    assert_eq!(
        progress.iter().filter(|l| l.ends_with(" cached")).count(),
        2,
        "{progress:?}"
    );
    assert!(
        !progress.iter().any(|l| l.starts_with("pulling layer")),
        "{progress:?}"
    );

    // Another owner reuses the unpacked layers only after downloading and checking them, so
    // a forged image naming a cached layer's diff id gets nothing.
    let (as_b, owned) = pull_as(&cache, "team-b", &reference).await;
    assert_eq!(as_b.unwrap().layers, image.layers);
    assert_eq!(
        owned
            .iter()
            .filter(|l| l.starts_with("verifying access"))
            .count(),
        2,
        "{owned:?}"
    );
    let (again, again_b) = pull_as(&cache, "team-b", &reference).await;
    again.unwrap();
    assert!(
        !again_b.iter().any(|l| l.starts_with("verifying")),
        "{again_b:?}"
    );
    let forged_ref = format!("{host}/tiny:forged");
    let err = cache
        .pull_for("team-c", &forged_ref, None, &|_| {}, 1 << 30)
        .await
        .unwrap_err();
    assert!(matches!(err, PullError::DigestMismatch { .. }), "{err}");

    // A pull writes no more than its limit: the busybox layer does not fit in 64 KiB and
    // nothing of it stays (the small top layer, unpacked alongside, may).
    let small = ImageCache::new(tmp.path().join("small"), loopback_allowed());
    let err = small
        .pull_for("team-d", &reference, None, &|_| {}, 64 << 10)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("65536 bytes"), "{err}");
    let left = names(&small.layers_dir());
    assert!(left.iter().all(|n| *n == top_id[7..]), "{left:?}");

    // By digest, and through an index that also lists another architecture.
    let pinned = format!("{host}/tiny@{}", image.manifest_digest);
    let (by_digest, _) = pull(&cache, &pinned).await;
    assert_eq!(by_digest.unwrap().layers, image.layers);
    let (multi, progress) = pull(&cache, &format!("{host}/tiny:multi")).await;
    let multi = multi.unwrap();
    assert_eq!(multi.manifest_digest, image.manifest_digest, "{progress:?}");
    assert_eq!(multi.layers, image.layers);

    // Two pulls of the same image into an empty cache at once.
    let fresh = ImageCache::new(tmp.path().join("fresh"), loopback_allowed());
    let (a, b) = tokio::join!(pull(&fresh, &reference), pull(&fresh, &reference));
    assert_eq!(a.0.unwrap().layers.len(), 2);
    assert_eq!(b.0.unwrap().layers.len(), 2);
    let mut expected = vec![base_id[7..].to_owned(), top_id[7..].to_owned()];
    expected.sort();
    assert_eq!(names(&fresh.layers_dir()), expected);

    // Failures.
    let error = |result: (Result<PulledImage, PullError>, Vec<String>)| result.0.unwrap_err();
    let err = error(pull(&cache, &format!("{host}/tiny:no-such-tag")).await);
    assert!(matches!(err, PullError::NotFound { .. }), "{err}");
    let err = error(pull(&cache, &format!("{host}/no-such-repo:1")).await);
    assert!(matches!(err, PullError::NotFound { .. }), "{err}");
    let err = error(pull(&cache, &format!("{host}/tiny@sha256:{}", "0".repeat(64))).await);
    assert!(matches!(err, PullError::NotFound { .. }), "{err}");
    let err = error(pull(&cache, &format!("{host}/tiny:foreign")).await);
    assert!(matches!(err, PullError::NoPlatform { .. }), "{err}");
    let err = error(pull(&cache, &format!("{host}/tiny:wrong-diff")).await);
    assert!(
        matches!(&err, PullError::DigestMismatch { expected, .. } if expected == &wrong_diff.2),
        "{err}"
    );
    let err = error(pull(&cache, &format!("{host}/tiny:corrupt")).await);
    assert!(
        matches!(&err, PullError::DigestMismatch { expected, .. } if *expected == sha256(&corrupt.0)),
        "{err}"
    );
    // Failed pulls leave nothing behind.
    let mut cached = vec![base_id[7..].to_owned(), top_id[7..].to_owned()];
    cached.sort();
    assert_eq!(names(&layers_dir), cached);
    assert!(
        !names(&cache_dir.join("blobs/sha256"))
            .iter()
            .any(|n| n.starts_with(".tmp-"))
    );

    let closed = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let err = error(pull(&cache, &format!("127.0.0.1:{closed}/tiny:1")).await);
    assert!(matches!(err, PullError::Unreachable { .. }), "{err}");
    drop(registry);
    let err = error(pull(&cache, &reference).await);
    assert!(matches!(err, PullError::Unreachable { .. }), "{err}");
}

/// Mounts the pulled layers as overlayfs does for a sandbox, where this machine allows it.
fn check_overlay(tmp: &Path, image: &PulledImage) {
    let merged = tmp.join("merged");
    std::fs::create_dir(&merged).unwrap();
    let lowers: Vec<String> = image
        .layers
        .iter()
        .rev()
        .map(|l| l.path.display().to_string())
        .collect();
    let options =
        std::ffi::CString::new(format!("lowerdir={},userxattr", lowers.join(":"))).unwrap();
    if let Err(e) = rustix::mount::mount(
        "overlay",
        &merged,
        "overlay",
        rustix::mount::MountFlags::RDONLY,
        Some(options.as_c_str()),
    ) {
        eprintln!("overlay mount not possible here ({e}); checked the layers only");
        return;
    }
    let view = (
        merged.join("to-delete").exists(),
        names(&merged.join("data")),
        std::fs::read_to_string(merged.join("etc/greeting")).unwrap(),
        merged.join("bin/busybox").is_file(),
    );
    rustix::mount::unmount(&merged, rustix::mount::UnmountFlags::DETACH).unwrap();
    assert_eq!(
        view,
        (
            false,
            vec!["new".to_owned()],
            "hello again\n".to_owned(),
            true
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authenticates_with_basic_credentials() {
    if !have_all(&[DOCKER_REGISTRY, SKOPEO, HTPASSWD]) {
        return;
    }
    let (tmp, registry) = registry_with_user("puller", "s3cret");

    let (tar, diff_id) = layer(|b| add_file(b, "private", 0o600, b"for puller only\n"));
    let mut oci = Layout::new(tmp.path().join("layout"));
    let image = oci.image(
        host_arch(),
        &[&(
            gzip(&tar),
            "application/vnd.oci.image.layer.v1.tar+gzip",
            diff_id.clone(),
        )],
    );
    oci.tag(image, "1");
    oci.push_as("1", &registry, false, Some("puller:s3cret"));

    let cache = ImageCache::new(tmp.path().join("cache"), loopback_allowed());
    let reference = format!("{}/tiny:1", registry.host());
    let right = RegistryAuth {
        username: "puller".into(),
        password: "s3cret".into(),
    };
    let wrong = RegistryAuth {
        username: "puller".into(),
        password: "guess".into(),
    };
    for auth in [None, Some(&wrong)] {
        let err = cache.pull(&reference, auth, &|_| {}).await.unwrap_err();
        assert!(
            matches!(&err, PullError::Unauthorized { reference: r } if *r == reference),
            "{err}"
        );
    }
    let image = cache.pull(&reference, Some(&right), &|_| {}).await.unwrap();
    assert_eq!(image.layers.len(), 1);
    assert_eq!(image.layers[0].diff_id, diff_id);
    let private = std::fs::read_to_string(image.layers[0].path.join("private")).unwrap();
    assert_eq!(private, "for puller only\n");
}
