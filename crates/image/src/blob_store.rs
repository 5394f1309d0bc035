//! One repository of an OCI registry used as a content-addressed store of files: a cluster's
//! nodes put the layers they built there and fetch the layers they lack (distribution spec,
//! "pushing blobs" and "pulling blobs"; no manifests are needed, blobs are found by digest).
//!
//! Each blob is also tagged `sha256-<hex>` with a manifest naming it as its only layer, so a
//! registry's garbage collection keeps it.
//!
//! Uploads are chunked (`POST`, a `PATCH` per chunk, a closing `PUT` with the digest), so a
//! layer of any size streams from disk with a bounded buffer. Downloads are hashed as they
//! are written and refused when the digest or the announced size does not match.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use reqwest::header::{
    CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, HeaderName, HeaderValue, LOCATION,
};
use reqwest::{Method, StatusCode};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use url::Url;

use crate::distribution::Session;
use crate::registry::{PullError, RegistryAuth};
use crate::registry_address::RegistryPolicy;

/// What one `PATCH` carries; the registry keeps the parts, the node holds one in memory.
const CHUNK_BYTES: usize = 16 << 20;
const MANIFEST_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
const OCTET_STREAM: &str = "application/octet-stream";
/// The OCI "empty" descriptor's content: the config of a manifest that only holds a blob.
const EMPTY_CONFIG: &[u8] = b"{}";
const EMPTY_CONFIG_DIGEST: &str =
    "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a";

/// The repository, as `http[s]://host[:port]/path/of/repository`.
#[derive(Debug)]
pub struct BlobStore {
    session: Session,
    location: String,
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BlobStoreError {
    #[error("bad layer store `{location}`: {reason}")]
    BadLocation { location: String, reason: String },
    #[error("layer store {location}: {source}")]
    Registry {
        location: String,
        #[source]
        source: PullError,
    },
    #[error("layer store {location} has no blob {digest}")]
    Missing { location: String, digest: String },
    #[error("blob {digest} from {location} has digest {actual}")]
    DigestMismatch {
        location: String,
        digest: String,
        actual: String,
    },
    #[error("blob {digest} from {location} is not the {expected} bytes recorded")]
    WrongSize {
        location: String,
        digest: String,
        expected: u64,
    },
    #[error(
        "layer store {location} refuses to delete blob {digest}'s tag (enable deletes in the registry's storage configuration)"
    )]
    DeletesDisabled { location: String, digest: String },
    #[error("blob {digest}: {}: {source}", path.display())]
    Io {
        digest: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// `sha256:<64 hex>`, the only digests blobs are stored under here.
pub fn is_sha256_digest(digest: &str) -> bool {
    digest
        .strip_prefix("sha256:")
        .is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

impl BlobStore {
    /// `location`: `http://` or `https://`, the registry's host and port, and the repository.
    /// `policy` decides which addresses the registry may have, as for pulls.
    pub fn new(
        location: &str,
        credentials: Option<&RegistryAuth>,
        policy: Arc<RegistryPolicy>,
    ) -> Result<Self, BlobStoreError> {
        let bad = |reason: &str| BlobStoreError::BadLocation {
            location: location.to_owned(),
            reason: reason.to_owned(),
        };
        let url = Url::parse(location).map_err(|e| bad(&e.to_string()))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(bad("the scheme must be http or https"));
        }
        if url.host_str().is_none() || url.query().is_some() || url.fragment().is_some() {
            return Err(bad("expected http[s]://host[:port]/repository"));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(bad(
                "credentials belong in their own file, not in the address",
            ));
        }
        let repository = url.path().trim_matches('/').to_owned();
        let valid_component = |c: &str| {
            !c.is_empty()
                && c.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
                })
        };
        if repository.is_empty() || !repository.split('/').all(valid_component) {
            return Err(bad(
                "the repository must be lower-case path components of letters, digits, `.`, `_` and `-`",
            ));
        }
        let mut registry = url.clone();
        registry.set_path("/");
        let session = Session::new(policy, &registry, &repository, location, credentials)
            .map_err(|source| BlobStoreError::Registry {
                location: location.to_owned(),
                source,
            })?
            .pushing();
        Ok(Self {
            session,
            location: location.to_owned(),
        })
    }

    pub fn location(&self) -> &str {
        &self.location
    }

    fn registry_error(&self, source: PullError) -> BlobStoreError {
        BlobStoreError::Registry {
            location: self.location.clone(),
            source,
        }
    }

    /// An answer of the registry this store cannot make sense of, `message` saying how.
    fn unexpected_answer(&self, message: impl Into<String>) -> BlobStoreError {
        self.registry_error(PullError::Registry {
            reference: self.location.clone(),
            message: message.into(),
        })
    }

    /// The URL of `path` in the repository.
    fn url(&self, path: &str) -> Result<Url, BlobStoreError> {
        self.session.url(path).map_err(|e| self.registry_error(e))
    }

    /// Sends a request; the answer, whatever its status.
    async fn call(
        &self,
        method: Method,
        url: Url,
        headers: &[(HeaderName, HeaderValue)],
        body: Option<Bytes>,
    ) -> Result<reqwest::Response, BlobStoreError> {
        self.session
            .call(method, url, headers, body)
            .await
            .map_err(|e| self.registry_error(e))
    }

    /// The registry's refusal that `response` is, described.
    async fn refusal(&self, response: reqwest::Response) -> BlobStoreError {
        self.registry_error(self.session.status_error(response).await)
    }

    fn blob_url(&self, digest: &str) -> Result<Url, BlobStoreError> {
        if !is_sha256_digest(digest) {
            return Err(BlobStoreError::BadLocation {
                location: self.location.clone(),
                reason: format!("`{digest}` is not a sha256 digest"),
            });
        }
        self.url(&format!("blobs/{digest}"))
    }

    /// Whether the repository holds `digest`.
    pub async fn contains(&self, digest: &str) -> Result<bool, BlobStoreError> {
        let url = self.blob_url(digest)?;
        let response = self.call(Method::HEAD, url, &[], None).await?;
        match response.status() {
            StatusCode::OK => Ok(true),
            StatusCode::NOT_FOUND => Ok(false),
            _ => Err(self.refusal(response).await),
        }
    }

    /// Uploads the file at `path`, whose sha256 is `digest`, unless the repository holds it,
    /// and tags it (see [`Self::keep`]).
    pub async fn push_file(&self, path: &Path, digest: &str) -> Result<(), BlobStoreError> {
        let io = |source| BlobStoreError::Io {
            digest: digest.to_owned(),
            path: path.to_owned(),
            source,
        };
        let size = tokio::fs::metadata(path).await.map_err(io)?.len();
        if !self.contains(digest).await? {
            self.upload(path, digest).await?;
        }
        self.keep(digest, size).await
    }

    /// Tags the blob `digest` (`sha256-<hex>`) with a manifest that names it as its only
    /// layer: a registry's garbage collection removes blobs no manifest references.
    /// Deleting the tag lets it go.
    pub async fn keep(&self, digest: &str, size: u64) -> Result<(), BlobStoreError> {
        let tag = format!(
            "sha256-{}",
            digest.strip_prefix("sha256:").unwrap_or(digest)
        );
        if !self.contains(EMPTY_CONFIG_DIGEST).await? {
            self.upload_bytes(Bytes::from_static(EMPTY_CONFIG), EMPTY_CONFIG_DIGEST)
                .await?;
        }
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "config": {
                "mediaType": "application/vnd.oci.empty.v1+json",
                "digest": EMPTY_CONFIG_DIGEST,
                "size": EMPTY_CONFIG.len(),
            },
            "layers": [{
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": digest,
                "size": size,
            }],
        });
        let url = self.url(&format!("manifests/{tag}"))?;
        self.expect(
            Method::PUT,
            url,
            &[(CONTENT_TYPE, HeaderValue::from_static(MANIFEST_TYPE))],
            Bytes::from(manifest.to_string()),
            StatusCode::CREATED,
        )
        .await?;
        Ok(())
    }

    /// The digests of every blob tagged here (see [`Self::keep`]), page by page.
    pub async fn kept(&self) -> Result<Vec<String>, BlobStoreError> {
        const PAGE: usize = 1000;
        let mut digests = Vec::new();
        let mut last: Option<String> = None;
        loop {
            let mut url = self.url("tags/list")?;
            url.query_pairs_mut()
                .append_pair("n", &PAGE.to_string())
                .extend_pairs(last.as_ref().map(|l| ("last", l.as_str())));
            let response = self.call(Method::GET, url, &[], None).await?;
            match response.status() {
                StatusCode::OK => {}
                // Nothing was ever pushed to the repository.
                StatusCode::NOT_FOUND => return Ok(digests),
                _ => return Err(self.refusal(response).await),
            }
            #[derive(serde::Deserialize)]
            struct Tags {
                #[serde(default)]
                tags: Option<Vec<String>>,
            }
            let page: Tags = response
                .json()
                .await
                .map_err(|e| self.unexpected_answer(format!("an unreadable tag list: {e}")))?;
            let tags = page.tags.unwrap_or_default();
            let full = tags.len() >= PAGE;
            last = tags.last().cloned();
            digests.extend(tags.iter().filter_map(|tag| {
                let digest = format!("sha256:{}", tag.strip_prefix("sha256-")?);
                is_sha256_digest(&digest).then_some(digest)
            }));
            if !full {
                return Ok(digests);
            }
        }
    }

    /// Deletes the tag that keeps blob `digest` (see [`Self::keep`]), so the registry's
    /// garbage collection may remove the blob; whether there was one.
    pub async fn let_go(&self, digest: &str) -> Result<bool, BlobStoreError> {
        self.blob_url(digest)?;
        let tag = format!("sha256-{}", digest.trim_start_matches("sha256:"));
        let url = self.url(&format!("manifests/{tag}"))?;
        let accept = [(
            reqwest::header::ACCEPT,
            HeaderValue::from_static(MANIFEST_TYPE),
        )];
        let response = self.call(Method::HEAD, url, &accept, None).await?;
        match response.status() {
            StatusCode::OK => {}
            StatusCode::NOT_FOUND => return Ok(false),
            _ => return Err(self.refusal(response).await),
        }
        // Registries delete manifests by their own digest, not by tag.
        let manifest = response
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .filter(|d| is_sha256_digest(d))
            .map(str::to_owned)
            .ok_or_else(|| self.unexpected_answer(format!("tag {tag} has no manifest digest")))?;
        let url = self.url(&format!("manifests/{manifest}"))?;
        let response = self.call(Method::DELETE, url, &[], None).await?;
        match response.status() {
            StatusCode::ACCEPTED | StatusCode::OK | StatusCode::NOT_FOUND => Ok(true),
            StatusCode::METHOD_NOT_ALLOWED => Err(BlobStoreError::DeletesDisabled {
                location: self.location.clone(),
                digest: digest.to_owned(),
            }),
            _ => Err(self.refusal(response).await),
        }
    }

    /// Sends a request and returns the answer if it has the status `expected`; any other
    /// answer is the registry's refusal, described.
    async fn expect(
        &self,
        method: Method,
        url: Url,
        headers: &[(HeaderName, HeaderValue)],
        body: Bytes,
        expected: StatusCode,
    ) -> Result<reqwest::Response, BlobStoreError> {
        let response = self.call(method, url, headers, Some(body)).await?;
        if response.status() != expected {
            return Err(self.refusal(response).await);
        }
        Ok(response)
    }

    /// A small blob in one request (`POST`, then `PUT` with the body and the digest).
    async fn upload_bytes(&self, data: Bytes, digest: &str) -> Result<(), BlobStoreError> {
        let mut upload = self.start_upload().await?;
        upload.query_pairs_mut().append_pair("digest", digest);
        self.expect(
            Method::PUT,
            upload,
            &[(CONTENT_TYPE, HeaderValue::from_static(OCTET_STREAM))],
            data,
            StatusCode::CREATED,
        )
        .await?;
        Ok(())
    }

    /// Opens an upload session; its URL.
    async fn start_upload(&self) -> Result<Url, BlobStoreError> {
        let start = self.url("blobs/uploads/")?;
        let response = self
            .expect(
                Method::POST,
                start,
                &[(CONTENT_LENGTH, HeaderValue::from_static("0"))],
                Bytes::new(),
                StatusCode::ACCEPTED,
            )
            .await?;
        self.next_location(&response)
    }

    /// Uploads the file at `path` in chunks.
    async fn upload(&self, path: &Path, digest: &str) -> Result<(), BlobStoreError> {
        let io = |source| BlobStoreError::Io {
            digest: digest.to_owned(),
            path: path.to_owned(),
            source,
        };
        let mut file = tokio::fs::File::open(path).await.map_err(io)?;
        let mut upload = self.start_upload().await?;
        let mut offset: u64 = 0;
        let mut hasher = Sha256::new();
        loop {
            let mut chunk = Vec::with_capacity(CHUNK_BYTES);
            (&mut file)
                .take(CHUNK_BYTES as u64)
                .read_to_end(&mut chunk)
                .await
                .map_err(io)?;
            if chunk.is_empty() {
                break;
            }
            hasher.update(&chunk);
            let end = offset + chunk.len() as u64 - 1;
            let range = HeaderValue::from_str(&format!("{offset}-{end}"))
                .map_err(|e| io(std::io::Error::other(e)))?;
            offset = end + 1;
            let response = self
                .expect(
                    Method::PATCH,
                    upload,
                    &[
                        (CONTENT_TYPE, HeaderValue::from_static(OCTET_STREAM)),
                        (CONTENT_RANGE, range),
                    ],
                    Bytes::from(chunk),
                    StatusCode::ACCEPTED,
                )
                .await?;
            upload = self.next_location(&response)?;
        }
        // The file changed under the upload, or the caller's digest is wrong; the registry
        // would refuse the closing PUT anyway.
        self.check_digest(digest, hasher)?;
        upload.query_pairs_mut().append_pair("digest", digest);
        self.expect(
            Method::PUT,
            upload,
            &[(CONTENT_LENGTH, HeaderValue::from_static("0"))],
            Bytes::new(),
            StatusCode::CREATED,
        )
        .await?;
        Ok(())
    }

    /// The upload's next URL, from a `202 Accepted`.
    fn next_location(&self, response: &reqwest::Response) -> Result<Url, BlobStoreError> {
        let location = response
            .headers()
            .get(LOCATION)
            .and_then(|l| l.to_str().ok())
            .ok_or_else(|| self.unexpected_answer("an upload answer without a location"))?;
        self.url(location)
    }

    /// Downloads `digest`, which is `size` bytes, into a new file at `dest`; on any failure,
    /// a mismatch included, nothing is left at `dest`.
    pub async fn fetch_to(
        &self,
        digest: &str,
        size: u64,
        dest: &Path,
    ) -> Result<(), BlobStoreError> {
        let fetched = self.fetch_inner(digest, size, dest).await;
        if fetched.is_err() {
            let _ = tokio::fs::remove_file(dest).await;
        }
        fetched
    }

    async fn fetch_inner(
        &self,
        digest: &str,
        size: u64,
        dest: &Path,
    ) -> Result<(), BlobStoreError> {
        // Checks the digest's form before it becomes part of a URL.
        self.blob_url(digest)?;
        let io = |source| BlobStoreError::Io {
            digest: digest.to_owned(),
            path: dest.to_owned(),
            source,
        };
        let mut response = match self.session.blob(digest).await {
            Ok(response) => response,
            Err(PullError::NotFound { .. }) => {
                return Err(BlobStoreError::Missing {
                    location: self.location.clone(),
                    digest: digest.to_owned(),
                });
            }
            Err(e) => return Err(self.registry_error(e)),
        };
        let wrong_size = || BlobStoreError::WrongSize {
            location: self.location.clone(),
            digest: digest.to_owned(),
            expected: size,
        };
        if response
            .content_length()
            .is_some_and(|length| length != size)
        {
            return Err(wrong_size());
        }
        let mut file = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(dest)
            .await
            .map_err(io)?;
        let mut hasher = Sha256::new();
        let mut written: u64 = 0;
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| self.registry_error(self.session.stream_error(&e)))?
        {
            written += chunk.len() as u64;
            if written > size {
                return Err(wrong_size());
            }
            hasher.update(&chunk);
            file.write_all(&chunk).await.map_err(io)?;
        }
        if written != size {
            return Err(wrong_size());
        }
        file.sync_all().await.map_err(io)?;
        self.check_digest(digest, hasher)
    }

    /// Refuses content that `hasher` has read all of unless its digest is `digest`.
    fn check_digest(&self, digest: &str, hasher: Sha256) -> Result<(), BlobStoreError> {
        let actual = format!("sha256:{}", hex::encode(hasher.finalize()));
        if actual != digest {
            return Err(BlobStoreError::DigestMismatch {
                location: self.location.clone(),
                digest: digest.to_owned(),
                actual,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Arc<RegistryPolicy> {
        Arc::new(RegistryPolicy::new(vec![], vec![], vec![]).expect("policy"))
    }

    #[test]
    fn locations_are_checked() {
        for good in [
            "http://127.0.0.1:5000/sandbar/layers",
            "https://registry.example:443/layers",
        ] {
            BlobStore::new(good, None, policy()).expect(good);
        }
        for bad in [
            "ftp://host/layers",
            "http://host:5000/",
            "http://host/Upper",
            "http://user:pw@host/layers",
            "http://host/layers?x=1",
            "not a url",
        ] {
            assert!(
                matches!(
                    BlobStore::new(bad, None, policy()),
                    Err(BlobStoreError::BadLocation { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn only_sha256_digests_name_blobs() {
        assert!(is_sha256_digest(&format!("sha256:{}", "a".repeat(64))));
        assert!(!is_sha256_digest(&format!("sha512:{}", "a".repeat(64))));
        assert!(!is_sha256_digest("sha256:../../etc"));
        assert!(!is_sha256_digest(&format!("sha256:{}", "g".repeat(64))));
    }
}
