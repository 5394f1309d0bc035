//! The layer store's uploads and downloads against a real registry on 127.0.0.1: chunked
//! pushes of files larger than a chunk, digests checked both ways, credentials through the
//! registry's challenge. Skipped, with a note on stderr, where `docker-registry` is missing.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use common::{DOCKER_REGISTRY, HTPASSWD, Registry, have_all, registry_with_user};
use sandbar_image::{BlobStore, BlobStoreError, RegistryAuth, RegistryPolicy};
use sha2::{Digest, Sha256};

fn loopback_allowed() -> Arc<RegistryPolicy> {
    Arc::new(RegistryPolicy::new(vec!["127.0.0.1".parse().unwrap()], vec![], vec![]).unwrap())
}

/// The manifest tagged `tag` in the test repository, read with a plain HTTP request.
async fn manifest_tagged(registry: &Registry, tag: &str) -> serde_json::Value {
    let output = Command::new("curl")
        .args([
            "-sf",
            "-H",
            "Accept: application/vnd.oci.image.manifest.v1+json",
            &format!(
                "http://{}/v2/sandbar/layers/manifests/{tag}",
                registry.host()
            ),
        ])
        .output()
        .unwrap();
    assert!(output.status.success(), "no manifest tagged {tag}");
    serde_json::from_slice(&output.stdout).unwrap()
}

/// The test repository of `registry`, anonymously.
fn open_store(registry: &Registry) -> BlobStore {
    BlobStore::new(
        &format!("http://{}/sandbar/layers", registry.host()),
        None,
        loopback_allowed(),
    )
    .unwrap()
}

/// A registry of its own, its files in a temporary directory, and the store of its test
/// repository; none, with a note on stderr, where `docker-registry` is missing.
fn anonymous_registry() -> Option<(tempfile::TempDir, Registry, BlobStore)> {
    if !have_all(&[DOCKER_REGISTRY]) {
        return None;
    }
    let tmp = tempfile::tempdir().unwrap();
    let registry = Registry::start(tmp.path(), None);
    let store = open_store(&registry);
    Some((tmp, registry, store))
}

/// Fetches blob `digest`, whose content is `data`, from `store` into `dest`, and checks that
/// all of it arrived.
async fn assert_fetches(store: &BlobStore, digest: &str, data: &[u8], dest: &Path) {
    store
        .fetch_to(digest, data.len() as u64, dest)
        .await
        .unwrap();
    assert_eq!(std::fs::read(dest).unwrap(), data);
}

fn digest_of(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// 40 MiB that do not repeat in any chunk, so a misplaced chunk changes the digest.
fn payload() -> Vec<u8> {
    let mut data = Vec::with_capacity(40 << 20);
    let mut block = Sha256::digest(b"seed").to_vec();
    while data.len() < 40 << 20 {
        block = Sha256::digest(&block).to_vec();
        data.extend_from_slice(&block);
    }
    data.truncate((40 << 20) + 123);
    data
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_in_chunks_and_fetches_what_it_pushed() {
    let Some((tmp, registry, store)) = anonymous_registry() else {
        return;
    };

    let data = payload();
    let digest = digest_of(&data);
    let source = tmp.path().join("layer.tar");
    std::fs::write(&source, &data).unwrap();
    assert!(!store.contains(&digest).await.unwrap());
    store.push_file(&source, &digest).await.unwrap();
    assert!(store.contains(&digest).await.unwrap());
    assert_eq!(std::fs::read(registry.blob_file(&digest)).unwrap(), data);
    // Tagged, so that the registry's garbage collection keeps it.
    let tag = format!("sha256-{}", digest.strip_prefix("sha256:").unwrap());
    let manifest: serde_json::Value = manifest_tagged(&registry, &tag).await;
    assert_eq!(manifest["layers"][0]["digest"], digest.as_str());
    assert_eq!(manifest["layers"][0]["size"], data.len() as u64);
    // A second push of the same content finds it there.
    store.push_file(&source, &digest).await.unwrap();

    assert_fetches(&store, &digest, &data, &tmp.path().join("fetched.tar")).await;

    // A recorded size that is not the blob's leaves nothing behind.
    let short = tmp.path().join("short.tar");
    let err = store.fetch_to(&digest, 10, &short).await.unwrap_err();
    assert!(matches!(err, BlobStoreError::WrongSize { .. }), "{err}");
    assert!(!short.exists());

    // A digest the store never got.
    let absent = digest_of(b"absent");
    let err = store
        .fetch_to(&absent, 6, &tmp.path().join("absent"))
        .await
        .unwrap_err();
    assert!(matches!(err, BlobStoreError::Missing { .. }), "{err}");

    // A file whose content is not the digest it is pushed as is refused before the registry
    // would store it.
    let err = store.push_file(&source, &absent).await.unwrap_err();
    assert!(
        matches!(err, BlobStoreError::DigestMismatch { .. }),
        "{err}"
    );
    assert!(!store.contains(&absent).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_with_credentials_and_is_refused_without() {
    if !have_all(&[DOCKER_REGISTRY, HTPASSWD]) {
        return;
    }
    let (tmp, registry) = registry_with_user("node", "s3cret");
    let location = format!("http://{}/sandbar/layers", registry.host());
    let data = b"layer bytes\n".to_vec();
    let digest = digest_of(&data);
    let source = tmp.path().join("layer.tar");
    std::fs::write(&source, &data).unwrap();

    let anonymous = BlobStore::new(&location, None, loopback_allowed()).unwrap();
    let err = anonymous.push_file(&source, &digest).await.unwrap_err();
    assert!(err.to_string().contains("not authorized"), "{err}");

    let credentials = RegistryAuth {
        username: "node".into(),
        password: "s3cret".into(),
    };
    let store = BlobStore::new(&location, Some(&credentials), loopback_allowed()).unwrap();
    store.push_file(&source, &digest).await.unwrap();
    assert_fetches(&store, &digest, &data, &tmp.path().join("fetched")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_what_it_keeps_and_lets_go_of_it() {
    let Some((tmp, _registry, store)) = anonymous_registry() else {
        return;
    };
    assert!(
        store.kept().await.unwrap().is_empty(),
        "a repository never pushed to"
    );
    let mut digests = Vec::new();
    for content in [&b"first\n"[..], b"second\n"] {
        let digest = digest_of(content);
        let source = tmp.path().join("blob");
        std::fs::write(&source, content).unwrap();
        store.push_file(&source, &digest).await.unwrap();
        digests.push(digest);
    }
    let mut kept = store.kept().await.unwrap();
    kept.sort();
    let mut expected = digests.clone();
    expected.sort();
    assert_eq!(kept, expected);

    assert!(store.let_go(&digests[0]).await.unwrap());
    assert_eq!(store.kept().await.unwrap(), [digests[1].clone()]);
    assert!(!store.let_go(&digests[0]).await.unwrap(), "already let go");
    // The bytes stay until the registry's garbage collection runs; pushed again, the blob is
    // kept again.
    assert!(store.contains(&digests[0]).await.unwrap());
    let source = tmp.path().join("again");
    std::fs::write(&source, b"first\n").unwrap();
    store.push_file(&source, &digests[0]).await.unwrap();
    assert_eq!(store.kept().await.unwrap().len(), 2);

    let strict_dir = tmp.path().join("strict");
    std::fs::create_dir(&strict_dir).unwrap();
    let strict = Registry::start_without_deletes(&strict_dir);
    let store = open_store(&strict);
    store.push_file(&source, &digests[0]).await.unwrap();
    let err = store.let_go(&digests[0]).await.unwrap_err();
    assert!(
        matches!(err, BlobStoreError::DeletesDisabled { .. }),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_must_be_allowed() {
    let store = BlobStore::new(
        "http://127.0.0.1:9/sandbar/layers",
        None,
        Arc::new(RegistryPolicy::new(vec![], vec![], vec![]).unwrap()),
    )
    .unwrap();
    let err = store.contains(&digest_of(b"x")).await.unwrap_err();
    assert!(err.to_string().contains("127.0.0.1"), "{err}");
}
