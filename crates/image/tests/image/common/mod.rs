//! A real registry (`docker-registry` from the distribution project) on 127.0.0.1 for the
//! integration tests.

#![allow(clippy::unwrap_used, dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn have(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
}

// The programs the tests run, each with the Debian package that installs it, for `have_all`.
pub const DOCKER_REGISTRY: (&str, &str) = ("docker-registry", "docker-registry");
pub const SKOPEO: (&str, &str) = ("skopeo", "skopeo");
pub const HTPASSWD: (&str, &str) = ("htpasswd", "apache2-utils");

/// Whether every program of `tools` (each with the Debian package that installs it) is on
/// PATH; where one is missing, a note on stderr says that the test is skipped.
pub fn have_all(tools: &[(&str, &str)]) -> bool {
    if tools.iter().all(|(program, _)| have(program)) {
        return true;
    }
    let programs: Vec<&str> = tools.iter().map(|(program, _)| *program).collect();
    let packages: Vec<&str> = tools.iter().map(|(_, package)| *package).collect();
    eprintln!(
        "skipping: needs {} (apt-get install {})",
        programs.join(", "),
        packages.join(" ")
    );
    false
}

/// A registry of its own that only `user` with `password` may use, its files in a temporary
/// directory.
pub fn registry_with_user(user: &str, password: &str) -> (tempfile::TempDir, Registry) {
    let tmp = tempfile::tempdir().unwrap();
    let users = htpasswd(tmp.path(), user, password);
    let registry = Registry::start(tmp.path(), Some(&users));
    (tmp, registry)
}

/// Writes a file of one user, `user` with `password`, for [`Registry::start`] in `dir`.
pub fn htpasswd(dir: &Path, user: &str, password: &str) -> PathBuf {
    let users = dir.join("htpasswd");
    let output = Command::new("htpasswd")
        .args(["-Bbn", user, password])
        .output()
        .unwrap();
    assert!(output.status.success());
    std::fs::write(&users, output.stdout).unwrap();
    users
}

/// The registry process, killed when the test ends however it ends.
pub struct Registry {
    child: Child,
    pub port: u16,
    pub storage: PathBuf,
}

impl Registry {
    /// `htpasswd`: a file of users that must authenticate, or none for an open registry.
    /// Deletes are enabled.
    pub fn start(dir: &Path, htpasswd: Option<&Path>) -> Registry {
        Self::launch(dir, htpasswd, true)
    }

    /// An open registry that refuses deletes, as distribution does by default.
    #[allow(dead_code)]
    pub fn start_without_deletes(dir: &Path) -> Registry {
        Self::launch(dir, None, false)
    }

    fn launch(dir: &Path, htpasswd: Option<&Path>, deletes: bool) -> Registry {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let storage = dir.join("storage");
        let config = dir.join("registry.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\n\
                 storage:\n  delete:\n    enabled: {deletes}\n  filesystem:\n    rootdirectory: {}\n\
                 http:\n  addr: 127.0.0.1:{port}\n  secret: test-only\n{}",
                storage.display(),
                htpasswd.map_or_else(String::new, |file| format!(
                    "auth:\n  htpasswd:\n    realm: test\n    path: {}\n",
                    file.display()
                )),
            ),
        )
        .unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            // It logs every 404 at error level, and the test asks for several.
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut registry = Registry {
            child,
            port,
            storage,
        };
        // Ready when it answers HTTP, not when its port first accepts: a registry still
        // starting, or another process on a port picked twice, resets the first requests.
        let deadline = Instant::now() + Duration::from_secs(20);
        while !answers_http(port) {
            if let Ok(Some(status)) = registry.child.try_wait() {
                panic!("registry on port {port} exited before it answered: {status}");
            }
            assert!(Instant::now() < deadline, "registry did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        registry
    }

    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Where the registry keeps a blob's bytes.
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap();
        self.storage
            .join("docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }
}

/// Whether a server on `port` answers `GET /v2/` with an HTTP status line (any status: an
/// authenticating registry answers 401).
fn answers_http(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let mut head = [0u8; 5];
    stream
        .write_all(b"GET /v2/ HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .and_then(|()| stream.read_exact(&mut head))
        .is_ok_and(|()| &head == b"HTTP/")
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
