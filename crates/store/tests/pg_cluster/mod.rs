//! A throwaway PostgreSQL cluster for a test binary: made with `initdb` in a temporary
//! directory the first time a test asks for it, listening only on a Unix socket in that
//! directory, with a database per test.
//!
//! Statics are never dropped, so the cluster's end is a watchdog's job: a shell started with
//! the cluster waits for this process to go (however it goes: exit, panic or a signal), then
//! stops the cluster and removes the directory. A cluster left behind anyway (the machine
//! stopped, the watchdog was killed) is removed by the next test binary that starts one.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection};

const PREFIX: &str = "sandbar-pg-test-";

#[derive(Debug)]
pub struct Cluster {
    dir: PathBuf,
    next_db: AtomicU32,
}

/// The user the cluster runs as: initdb and pg_ctl refuse root.
#[derive(Debug, Clone, Copy)]
struct RunAs {
    uid: u32,
    gid: u32,
}

fn bin_dir() -> PathBuf {
    std::env::var_os("SANDBAR_PG_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/lib/postgresql/15/bin"))
}

fn command(program: &Path, run_as: Option<RunAs>) -> Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(program);
    if let Some(user) = run_as {
        cmd.uid(user.uid).gid(user.gid);
    }
    // Out of the test's process group: a Ctrl-C meant for the tests must leave the cluster
    // to the watchdog, which then still runs to remove it.
    cmd.process_group(0);
    cmd
}

fn id_of(flag: &str) -> Result<u32, String> {
    let out = Command::new("id")
        .args([flag, "postgres"])
        .output()
        .map_err(|e| format!("cannot run id: {e}"))?;
    if !out.status.success() {
        return Err("running as root and there is no postgres user to run the cluster".into());
    }
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|e| format!("bad id of postgres: {e}"))
}

fn run_as() -> Result<Option<RunAs>, String> {
    if !rustix::process::geteuid().is_root() {
        return Ok(None);
    }
    Ok(Some(RunAs {
        uid: id_of("-u")?,
        gid: id_of("-g")?,
    }))
}

fn run(cmd: &mut Command, what: &str) -> Result<(), String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {what}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{what} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Stops and removes clusters whose test binary is gone.
fn remove_stale(bin: &Path, user: Option<RunAs>) {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let dir = entry.path();
        let is_ours = entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(PREFIX));
        let Ok(owner) = std::fs::read_to_string(dir.join("owner.pid")) else {
            continue;
        };
        if !is_ours || Path::new(&format!("/proc/{}", owner.trim())).exists() {
            continue;
        }
        let _ = command(&bin.join("pg_ctl"), user)
            .args(["-D"])
            .arg(dir.join("data"))
            .args(["stop", "-m", "immediate"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn start() -> Result<Cluster, String> {
    let bin = bin_dir();
    for program in ["initdb", "pg_ctl", "postgres"] {
        if !bin.join(program).exists() {
            return Err(format!(
                "no {program} in {} (install postgresql-15 or set SANDBAR_PG_BIN)",
                bin.display()
            ));
        }
    }
    let user = run_as()?;
    remove_stale(&bin, user);
    let dir = tempfile::Builder::new()
        .prefix(PREFIX)
        .tempdir()
        .map_err(|e| format!("cannot make a directory for the cluster: {e}"))?
        .keep();
    std::fs::write(dir.join("owner.pid"), std::process::id().to_string())
        .map_err(|e| format!("cannot write owner.pid: {e}"))?;
    if let Some(user) = user {
        std::os::unix::fs::chown(&dir, Some(user.uid), Some(user.gid))
            .map_err(|e| format!("cannot give {} to postgres: {e}", dir.display()))?;
    }
    // Started first, so the directory goes whatever happens from here on.
    command(Path::new("/bin/sh"), user)
        .arg("-c")
        .arg(
            r#"while [ -e "/proc/$0" ]; do sleep 0.2; done
"$1/pg_ctl" -D "$2/data" stop -m immediate >/dev/null 2>&1
rm -rf "$2""#,
        )
        .arg(std::process::id().to_string())
        .arg(&bin)
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start the cluster's watchdog: {e}"))?;
    run(
        command(&bin.join("initdb"), user)
            .arg("-D")
            .arg(dir.join("data"))
            .args([
                "-U",
                "postgres",
                "-A",
                "trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--no-locale",
            ]),
        "initdb",
    )?;
    // No TCP at all; durability is not wanted from a throwaway cluster.
    let options = format!(
        "-c listen_addresses='' -k {} -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200",
        dir.display()
    );
    run(
        command(&bin.join("pg_ctl"), user)
            .arg("-D")
            .arg(dir.join("data"))
            .arg("-l")
            .arg(dir.join("log"))
            .args(["-w", "-t", "60", "-o", &options, "start"]),
        "pg_ctl start",
    )?;
    Ok(Cluster {
        dir,
        next_db: AtomicU32::new(0),
    })
}

/// The binary's cluster, started on first use; why there is none when PostgreSQL is missing.
pub fn cluster() -> Result<&'static Cluster, &'static str> {
    static CLUSTER: OnceLock<Result<Cluster, String>> = OnceLock::new();
    CLUSTER.get_or_init(start).as_ref().map_err(String::as_str)
}

impl Cluster {
    fn options(&self, database: &str) -> PgConnectOptions {
        PgConnectOptions::new()
            .socket(&self.dir)
            .username("postgres")
            .database(database)
    }

    /// A new, empty database's URL.
    pub async fn database(&self) -> String {
        let name = format!(
            "test_{}_{}",
            std::process::id(),
            self.next_db.fetch_add(1, Ordering::Relaxed)
        );
        let mut admin = PgConnection::connect_with(&self.options("postgres"))
            .await
            .expect("connect to the test cluster");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await
            .expect("create a test database");
        admin.close().await.expect("close");
        format!(
            "postgres://postgres@localhost/{name}?host={}",
            self.dir.display()
        )
    }
}
