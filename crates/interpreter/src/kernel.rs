//! One Jupyter kernel process and the ZeroMQ connections to it: requests go out on the shell
//! channel, and every message the kernel sends back (on shell or iopub) is routed by the id
//! of the request it answers.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jupyter_protocol::{
    ConnectionInfo, ExecuteRequest, JupyterMessage, JupyterMessageContent, KernelInfoRequest,
};
use jupyter_zmq_client::DealerSendConnection;
use tokio::sync::mpsc;

/// How long a new kernel may take to answer on both channels.
const START_PATIENCE: Duration = Duration::from_secs(60);
/// The same for a kernel over loopback TCP (Java's), which starts in 2–4 s here (its iopub
/// subscription renewed as [`Kernel::wait_answering`] says); one that still does not answer
/// is started again, up to [`TCP_START_ATTEMPTS`] times.
const TCP_START_PATIENCE: Duration = Duration::from_secs(15);
const TCP_START_ATTEMPTS: u32 = 3;

type Routes = Arc<Mutex<HashMap<String, mpsc::UnboundedSender<JupyterMessage>>>>;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot write the connection file {path}: {source}")]
    ConnectionFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start the kernel '{program}' in {cwd}: {source}")]
    Spawn {
        program: String,
        cwd: String,
        source: std::io::Error,
    },
    #[error("cannot connect to the kernel: {0}")]
    Connect(jupyter_zmq_client::RuntimeError),
    #[error("the kernel did not answer within {0:?}")]
    NotAnswering(Duration),
    #[error("the kernel exited while starting: {0}")]
    Exited(String),
}

#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error("cannot send to the kernel: {0}")]
    Send(jupyter_zmq_client::RuntimeError),
}

/// How to start a kernel: a program and its arguments, `{connection_file}` standing for the
/// connection file's path.
#[derive(Debug, Clone)]
pub struct KernelCommand {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Loopback TCP instead of Unix sockets, for a kernel whose ZeroMQ has no `ipc`
    /// transport (JeroMQ, under the Java kernel). Its connections do not survive a
    /// checkpoint's restore.
    pub tcp: bool,
    /// Interrupted with an `interrupt_request` on the control channel rather than SIGINT
    /// (a kernelspec's `interrupt_mode: message`; the Java kernel's JVM does not take the
    /// signal).
    pub interrupt_by_message: bool,
}

/// Five ports on 127.0.0.1 free a moment ago, for a kernel that binds them itself.
fn free_loopback_ports() -> std::io::Result<[u16; 5]> {
    let listeners = (0..5)
        .map(|_| std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)))
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut ports = [0u16; 5];
    for (port, listener) in ports.iter_mut().zip(&listeners) {
        *port = listener.local_addr()?.port();
    }
    Ok(ports)
}

pub struct Kernel {
    child: tokio::process::Child,
    shell: tokio::sync::Mutex<DealerSendConnection>,
    /// The kernel's connection and this client's session: an interrupt request (for a kernel
    /// interrupted by message) connects to its control channel when one is sent.
    connection: (ConnectionInfo, String),
    interrupt_by_message: bool,
    routes: Routes,
    connection_file: PathBuf,
    /// Its sockets are this path with `-<port>` appended.
    ipc_prefix: PathBuf,
    readers: Vec<tokio::task::JoinHandle<()>>,
    /// The sandbox environment last set in the kernel (see `Config::sandbox_env`).
    pub sandbox_env: Option<crate::sandbox_env::SandboxEnv>,
}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernel")
            .field("pid", &self.child.id())
            .finish_non_exhaustive()
    }
}

/// Bytes from the kernel's entropy, not from a generator in this process's memory: a server
/// restored from a template's capture runs on in every sandbox of the template, and would
/// otherwise draw the same ids and keys in all of them.
pub(crate) fn fresh_bytes() -> [u8; 16] {
    use rand::TryRngCore;
    let mut bytes = [0u8; 16];
    if rand::rngs::OsRng.try_fill_bytes(&mut bytes).is_err() {
        bytes = rand::random();
    }
    bytes
}

fn new_id() -> String {
    let bytes = fresh_bytes();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Kernel {
    /// Starts a kernel in `cwd` and returns once it answers on its shell and iopub channels.
    pub async fn start(
        command: &KernelCommand,
        cwd: &Path,
        runtime_dir: &Path,
    ) -> Result<Kernel, StartError> {
        if !command.tcp {
            return Self::start_once(command, cwd, runtime_dir, START_PATIENCE).await;
        }
        let mut attempt = 1;
        loop {
            match Self::start_once(command, cwd, runtime_dir, TCP_START_PATIENCE).await {
                Err(StartError::NotAnswering(waited)) if attempt < TCP_START_ATTEMPTS => {
                    tracing::warn!(
                        ?waited,
                        attempt,
                        "the kernel did not answer; starting it again"
                    );
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    async fn start_once(
        command: &KernelCommand,
        cwd: &Path,
        runtime_dir: &Path,
        patience: Duration,
    ) -> Result<Kernel, StartError> {
        let files = KernelFiles::new(runtime_dir);
        let info = files.write_connection_info(command, runtime_dir)?;
        let mut child = spawn_kernel(command, cwd, &files)?;
        if command.tcp {
            let ports = [info.shell_port, info.iopub_port, info.control_port];
            if let Err(e) = wait_listening(&mut child, &ports, patience).await {
                kill_group(&child);
                files.remove();
                return Err(e);
            }
        }
        let session = new_id();
        let routes: Routes = Arc::default();
        let (shell, mut iopub) = match connect(&info, &session, patience).await {
            Ok(connected) => connected,
            Err(e) => {
                kill_group(&child);
                files.remove();
                return Err(e);
            }
        };
        let (shell_send, mut shell_recv) = shell.split();
        let connection = (info.clone(), session.clone());
        let shell_routes = routes.clone();
        let iopub_routes = routes.clone();
        let readers = vec![
            tokio::spawn(async move {
                while let Ok(message) = shell_recv.read().await {
                    route(&shell_routes, message);
                }
            }),
            tokio::spawn(async move {
                while let Ok(message) = iopub.read().await {
                    route(&iopub_routes, message);
                }
            }),
        ];
        let mut kernel = Kernel {
            child,
            shell: tokio::sync::Mutex::new(shell_send),
            connection,
            interrupt_by_message: command.interrupt_by_message,
            routes,
            connection_file: files.connection_file,
            ipc_prefix: files.ipc_prefix,
            readers,
            sandbox_env: None,
        };
        kernel.wait_answering(patience).await?;
        Ok(kernel)
    }

    /// Asks for the kernel's info until its iopub channel shows the answer's status: only
    /// then is the subscription in place and no output of a request can be missed.
    async fn wait_answering(&mut self, patience: Duration) -> Result<(), StartError> {
        let deadline = tokio::time::Instant::now() + patience;
        let mut rounds = 0u32;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(StartError::Exited(status.to_string()));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(StartError::NotAnswering(patience));
            }
            rounds += 1;
            // A subscription over loopback TCP to JeroMQ (the Java kernel's) now and then sees
            // nothing while the shell channel works; a new one does.
            if self.connection.0.transport == jupyter_protocol::connection_info::Transport::TCP
                && rounds.is_multiple_of(4)
            {
                tracing::info!("no status from the kernel yet; subscribing to its iopub again");
                self.resubscribe().await?;
            }
            let request: JupyterMessage = KernelInfoRequest::default().into();
            // Bounded: a send to a peer that is not connected yet can wait for it forever,
            // and the deadline above must stay in charge.
            let Ok(Ok(mut replies)) =
                tokio::time::timeout(Duration::from_millis(500), self.send(request)).await
            else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let seen = tokio::time::timeout(Duration::from_millis(500), async {
                while let Some(message) = replies.recv().await {
                    if matches!(message.content, JupyterMessageContent::Status(_)) {
                        return true;
                    }
                }
                false
            })
            .await;
            if let Some(id) = replies.id.take() {
                self.forget(&id);
            }
            if seen == Ok(true) {
                return Ok(());
            }
        }
    }

    /// Replaces the iopub subscription (the last reader) with a new one.
    async fn resubscribe(&mut self) -> Result<(), StartError> {
        let (info, session) = &self.connection;
        let connecting = jupyter_zmq_client::create_client_iopub_connection(info, "", session);
        let Ok(connected) = tokio::time::timeout(Duration::from_secs(2), connecting).await else {
            // The next round tries again; the old subscription stays until then.
            return Ok(());
        };
        let mut iopub = connected.map_err(StartError::Connect)?;
        let routes = self.routes.clone();
        if let Some(old) = self.readers.pop() {
            old.abort();
        }
        self.readers.push(tokio::spawn(async move {
            while let Ok(message) = iopub.read().await {
                route(&routes, message);
            }
        }));
        Ok(())
    }

    /// Sends a request; the receiver gets every message that names it as parent.
    pub async fn send(&self, request: JupyterMessage) -> Result<Replies, SendError> {
        let id = request.header.msg_id.clone();
        let (tx, rx) = mpsc::unbounded_channel();
        self.routes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.clone(), tx);
        let sent = self.shell.lock().await.send(request).await;
        if let Err(e) = sent {
            self.forget(&id);
            return Err(SendError::Send(e));
        }
        Ok(Replies { id: Some(id), rx })
    }

    pub async fn execute(&self, code: String, silent: bool) -> Result<Replies, SendError> {
        let mut request = ExecuteRequest::new(code);
        request.silent = silent;
        request.store_history = !silent;
        request.stop_on_error = false;
        self.send(request.into()).await
    }

    pub fn forget(&self, id: &str) {
        self.routes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }

    /// Interrupts what the kernel runs, as a terminal's Ctrl-C would, or by message.
    pub fn interrupt(&self) {
        if self.interrupt_by_message {
            let (info, session) = self.connection.clone();
            tokio::spawn(async move {
                let mut control =
                    match jupyter_zmq_client::create_client_control_connection(&info, &session)
                        .await
                    {
                        Ok(control) => control,
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot reach the kernel's control channel");
                            return;
                        }
                    };
                let request: JupyterMessage = jupyter_protocol::InterruptRequest {}.into();
                if let Err(e) = control.send(request).await {
                    tracing::warn!(error = %e, "cannot send the kernel an interrupt request");
                    return;
                }
                // Its reply, read so that none pile up.
                let _ = tokio::time::timeout(Duration::from_secs(5), control.read()).await;
            });
            return;
        }
        if let Some(pid) = self
            .child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::INT);
        }
    }

    pub fn is_alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Ends the kernel and everything it started.
    pub async fn shutdown(mut self) {
        kill_group(&self.child);
        let _ = self.child.kill().await;
        for reader in self.readers.drain(..) {
            reader.abort();
        }
        remove_files(&self.connection_file, &self.ipc_prefix);
    }
}

/// Kills a kernel's process group: what it started (the Java kernel's launcher starts the
/// kernel's own JVM) goes with it.
fn kill_group(child: &tokio::process::Child) {
    if let Some(pid) = child
        .id()
        .and_then(|p| i32::try_from(p).ok())
        .and_then(rustix::process::Pid::from_raw)
    {
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        // A kernel given up on while starting; after `shutdown` the group is gone already.
        kill_group(&self.child);
        for reader in &self.readers {
            reader.abort();
        }
        remove_files(&self.connection_file, &self.ipc_prefix);
    }
}

/// Waits until a kernel that binds loopback TCP ports listens on them, read from
/// `/proc/net/tcp` and `tcp6` (Java binds 127.0.0.1 on a dual-stack socket) rather than by
/// connecting: JeroMQ (the Java kernel's ZeroMQ) does not get over a connection that closes
/// before ZeroMQ's greeting.
async fn wait_listening(
    child: &mut tokio::process::Child,
    ports: &[u16],
    patience: Duration,
) -> Result<(), StartError> {
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        let mut table = tokio::fs::read_to_string("/proc/net/tcp")
            .await
            .unwrap_or_default();
        table.push_str(
            &tokio::fs::read_to_string("/proc/net/tcp6")
                .await
                .unwrap_or_default(),
        );
        if ports.iter().all(|port| listening(&table, *port)) {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(StartError::Exited(status.to_string()));
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(StartError::NotAnswering(patience));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether `/proc/net/tcp` or `tcp6` (their text) has a socket listening on 127.0.0.1:`port`
/// (in `tcp6` as `::ffff:127.0.0.1`).
fn listening(table: &str, port: u16) -> bool {
    let v4 = format!("0100007F:{port:04X}");
    let v6 = format!("0000000000000000FFFF00000100007F:{port:04X}");
    table.lines().any(|line| {
        let mut fields = line.split_whitespace().skip(1);
        let local = fields.next();
        (local == Some(v4.as_str()) || local == Some(v6.as_str())) && fields.nth(1) == Some("0A")
    })
}

/// Removes a kernel's connection file and its sockets, which a killed kernel leaves behind.
fn remove_files(connection_file: &Path, ipc_prefix: &Path) {
    let _ = std::fs::remove_file(connection_file);
    for port in 1..=5 {
        let mut socket = ipc_prefix.as_os_str().to_owned();
        socket.push(format!("-{port}"));
        let _ = std::fs::remove_file(socket);
    }
}

/// The messages that answer one request.
#[derive(Debug)]
pub struct Replies {
    id: Option<String>,
    rx: mpsc::UnboundedReceiver<JupyterMessage>,
}

impl Replies {
    pub async fn recv(&mut self) -> Option<JupyterMessage> {
        self.rx.recv().await
    }

    pub fn id(&self) -> &str {
        self.id.as_deref().unwrap_or_default()
    }
}

fn route(routes: &Routes, message: JupyterMessage) {
    let Some(parent) = message.parent_header.as_ref().map(|h| h.msg_id.clone()) else {
        return;
    };
    let routes = routes.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(tx) = routes.get(&parent) {
        let _ = tx.send(message);
    }
}

fn write_private(path: &Path, body: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(body)
}

/// The files a kernel is started with: its connection file, and the prefix of its sockets.
struct KernelFiles {
    connection_file: PathBuf,
    ipc_prefix: PathBuf,
}

impl KernelFiles {
    fn new(runtime_dir: &Path) -> Self {
        let name = format!("kernel-{}", new_id());
        Self {
            // Unix sockets in the sandbox's own files rather than loopback TCP: a checkpoint
            // restores a connection between two of its processes over a Unix socket as it
            // was, where a restore closes TCP connections and ZeroMQ does not reconnect them.
            ipc_prefix: runtime_dir.join(format!("{name}-ipc")),
            connection_file: runtime_dir.join(format!("{name}.json")),
        }
    }

    fn error(&self, source: std::io::Error) -> StartError {
        StartError::ConnectionFile {
            path: self.connection_file.clone(),
            source,
        }
    }

    /// Chooses the kernel's channels and writes them, with a new key, where it reads them.
    fn write_connection_info(
        &self,
        command: &KernelCommand,
        runtime_dir: &Path,
    ) -> Result<ConnectionInfo, StartError> {
        let (transport, ip, [stdin_port, control_port, hb_port, shell_port, iopub_port]) =
            if command.tcp {
                (
                    jupyter_protocol::connection_info::Transport::TCP,
                    std::net::Ipv4Addr::LOCALHOST.to_string(),
                    free_loopback_ports().map_err(|e| self.error(e))?,
                )
            } else {
                (
                    jupyter_protocol::connection_info::Transport::IPC,
                    self.ipc_prefix.display().to_string(),
                    [1, 2, 3, 4, 5],
                )
            };
        let info = ConnectionInfo {
            transport,
            ip,
            stdin_port,
            control_port,
            hb_port,
            shell_port,
            iopub_port,
            signature_scheme: "hmac-sha256".into(),
            key: new_id(),
            kernel_name: None,
        };
        std::fs::create_dir_all(runtime_dir).map_err(|e| self.error(e))?;
        let body = serde_json::to_vec(&info).unwrap_or_default();
        write_private(&self.connection_file, &body).map_err(|e| self.error(e))?;
        Ok(info)
    }

    fn remove(&self) {
        remove_files(&self.connection_file, &self.ipc_prefix);
    }
}

/// Starts the kernel's process in a group of its own, killed with the server.
fn spawn_kernel(
    command: &KernelCommand,
    cwd: &Path,
    files: &KernelFiles,
) -> Result<tokio::process::Child, StartError> {
    let program = command.argv.first().cloned().unwrap_or_default();
    let connection_file = files.connection_file.display().to_string();
    let args = command
        .argv
        .iter()
        .skip(1)
        .map(|a| a.replace("{connection_file}", &connection_file));
    let mut process = tokio::process::Command::new(&program);
    process
        .args(args)
        .envs(command.env.iter().map(|(k, v)| (k, v)))
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        // Its own group, so whatever the code started goes with it.
        .process_group(0)
        .kill_on_drop(true);
    // SAFETY: only prctl, which is async-signal-safe, between fork and exec.
    unsafe {
        process.pre_exec(|| {
            // A server that dies by any means takes its kernels along; the signal goes
            // when the forking thread exits, and a runtime worker lives as long as the
            // server.
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
            Ok(())
        });
    }
    process.spawn().map_err(|source| {
        files.remove();
        StartError::Spawn {
            program: program.clone(),
            cwd: cwd.display().to_string(),
            source,
        }
    })
}

/// Opens the shell and iopub channels of the kernel described by `info`. Bounded too, so a
/// kernel that never accepts is started again rather than waited for until the client gives up.
async fn connect(
    info: &ConnectionInfo,
    session: &str,
    patience: Duration,
) -> Result<
    (
        jupyter_zmq_client::ClientShellConnection,
        jupyter_zmq_client::ClientIoPubConnection,
    ),
    StartError,
> {
    let identity =
        jupyter_zmq_client::peer_identity_for_session(session).map_err(StartError::Connect)?;
    let connecting = async {
        let shell = jupyter_zmq_client::create_client_shell_connection_with_identity(
            info, session, identity,
        )
        .await?;
        let iopub = jupyter_zmq_client::create_client_iopub_connection(info, "", session).await?;
        Ok((shell, iopub))
    };
    match tokio::time::timeout(patience, connecting).await {
        Ok(Ok(connected)) => Ok(connected),
        Ok(Err(e)) => Err(StartError::Connect(e)),
        Err(_) => Err(StartError::NotAnswering(patience)),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn listening_sockets_are_read_from_proc_net_tcp() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   \
            0: 0100007F:9C41 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 1 1\n   \
            1: 0100007F:9C42 0100007F:9C41 01 00000000:00000000 00:00000000 00000000  1000        0 2 1\n";
        assert!(super::listening(table, 0x9C41));
        assert!(!super::listening(table, 0x9C42));
        assert!(!super::listening(table, 80));
        let v6 = "   0: 0000000000000000FFFF00000100007F:A1B2 00000000000000000000000000000000:0000 0A 0 0\n";
        assert!(super::listening(v6, 0xA1B2));
    }
}
