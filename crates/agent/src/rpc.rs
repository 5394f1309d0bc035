//! `process.Process` and `filesystem.Filesystem` on the Connect protocol.

use std::sync::Arc;
use std::time::Duration;

use buffa::MessageField;
use connectrpc::{
    ConnectError, InboundStream, RequestContext, Response, ServiceRequest, ServiceResult,
    ServiceStream,
};
use futures_util::StreamExt;
use http::HeaderMap;
use tokio::sync::mpsc;

use crate::AgentState;
use crate::auth::basic_auth_user;
use crate::fs::{FsError, resolve_path};
use crate::process::{DEFAULT_PATH, ProcessError, ProcessOutput, PtySize, Selector, SpawnSpec};
use crate::proto::filesystem::{self as fsp, Filesystem};
use crate::proto::process::{self as pp, Process};
use crate::users::{Accounts, User, UserError};
use crate::watch::{WatchError, WatchSpec, WatcherError};

const KEEPALIVE_HEADER: &str = "keepalive-ping-interval";

/// Implements both Connect services over the shared agent state.
#[derive(Debug, Clone)]
pub struct Services {
    state: Arc<AgentState>,
}

impl Services {
    /// Wraps the agent state.
    pub fn new(state: Arc<AgentState>) -> Self {
        Self { state }
    }

    /// The calling user: `Authorization: Basic` names one, else the configured default.
    fn user(&self, headers: &HeaderMap) -> Result<(User, Accounts), ConnectError> {
        let name = basic_auth_user(headers)
            .or_else(|| Some(self.state.config().default_user.clone()).filter(|u| !u.is_empty()))
            .ok_or_else(|| ConnectError::unauthenticated("no user specified"))?;
        let accounts = Accounts::load().map_err(user_error)?;
        let user = accounts.user(&name).map_err(user_error)?;
        Ok((user, accounts))
    }

    /// The process a request's selector names.
    fn process(
        &self,
        selected: Option<&pp::ProcessSelector>,
    ) -> Result<Arc<crate::process::ManagedProcess>, ConnectError> {
        self.state
            .processes
            .get(&selector(selected)?)
            .map_err(process_error)
    }
}

fn user_error(e: UserError) -> ConnectError {
    match e {
        // envd answers unknown users with `unauthenticated` too.
        UserError::UnknownUser(_) => ConnectError::unauthenticated(e.to_string()),
        UserError::Read { .. } => ConnectError::internal(e.to_string()),
    }
}

fn fs_error(e: FsError) -> ConnectError {
    let message = e.to_string();
    match e {
        FsError::NotFound(_) => ConnectError::not_found(message),
        FsError::AlreadyExists(_) => ConnectError::already_exists(message),
        FsError::Invalid { .. } => ConnectError::invalid_argument(message),
        FsError::PermissionDenied(_) => ConnectError::permission_denied(message),
        FsError::Io { ref source, .. }
            if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) =>
        {
            ConnectError::resource_exhausted(message)
        }
        FsError::Io { .. } => ConnectError::internal(message),
    }
}

/// Runs `work`, which may walk a whole tree, on a thread where blocking is allowed.
async fn off_the_runtime<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, FsError> + Send + 'static,
) -> Result<T, ConnectError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ConnectError::internal(e.to_string()))?
        .map_err(fs_error)
}

fn process_error(e: ProcessError) -> ConnectError {
    let message = e.to_string();
    match e {
        ProcessError::NotFound(_) => ConnectError::not_found(message),
        ProcessError::Spawn { ref source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            ConnectError::invalid_argument(message)
        }
        ProcessError::StdinClosed(_) | ProcessError::NoPty(_) | ProcessError::IsPty(_) => {
            ConnectError::failed_precondition(message)
        }
        ProcessError::TagInUse(_) => ConnectError::already_exists(message),
        ProcessError::Spawn { .. }
        | ProcessError::Io { .. }
        | ProcessError::Write { .. }
        | ProcessError::Signal { .. } => ConnectError::internal(message),
    }
}

fn watcher_error(e: WatcherError) -> ConnectError {
    match e {
        WatcherError::NotFound(_) => ConnectError::not_found(e.to_string()),
        WatcherError::Watch(e) => watch_error(e),
    }
}

fn watch_error(e: WatchError) -> ConnectError {
    match e {
        WatchError::Fs(e) => fs_error(e),
        // envd's answer: the request asked for what this path cannot give.
        WatchError::NetworkMount { .. } => ConnectError::invalid_argument(e.to_string()),
    }
}

fn keepalive_interval(headers: &HeaderMap) -> Option<Duration> {
    let secs: u64 = headers
        .get(KEEPALIVE_HEADER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    (secs > 0).then(|| Duration::from_secs(secs))
}

fn keepalive_timer(period: Option<Duration>) -> Option<tokio::time::Interval> {
    period.map(|p| {
        let mut timer = tokio::time::interval_at(tokio::time::Instant::now() + p, p);
        timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        timer
    })
}

fn selector(process: Option<&pp::ProcessSelector>) -> Result<Selector, ConnectError> {
    use crate::proto::process::__buffa::oneof::process_selector::Selector as S;
    match process.and_then(|p| p.selector.as_ref()) {
        Some(S::Pid(pid)) => Ok(Selector::Pid(*pid)),
        Some(S::Tag(tag)) => Ok(Selector::Tag(tag.clone())),
        None => Err(ConnectError::invalid_argument(
            "process selector is required",
        )),
    }
}

fn event(e: impl Into<Option<pp::__buffa::oneof::process_event::Event>>) -> pp::ProcessEvent {
    pp::ProcessEvent {
        event: e.into(),
        ..Default::default()
    }
}

fn output_event(output: ProcessOutput) -> pp::ProcessEvent {
    use pp::__buffa::oneof::process_event::data_event::Output;
    let data = |o: Output| {
        event(pp::process_event::DataEvent {
            output: Some(o),
            ..Default::default()
        })
    };
    match output {
        ProcessOutput::Stdout(b) => data(Output::Stdout(b)),
        ProcessOutput::Stderr(b) => data(Output::Stderr(b)),
        ProcessOutput::Pty(b) => data(Output::Pty(b)),
        ProcessOutput::End(end) => event(pp::process_event::EndEvent {
            exit_code: end.exit_code,
            exited: end.exited,
            status: end.status,
            error: end.error,
            ..Default::default()
        }),
    }
}

struct EventStreamState<T> {
    pid: u32,
    rx: mpsc::Receiver<ProcessOutput>,
    keepalive: Option<tokio::time::Interval>,
    deadline: Option<tokio::time::Instant>,
    started: bool,
    finished: bool,
    wrap: fn(pp::ProcessEvent) -> T,
}

/// `start{pid}`, then output, then exactly one `end`, with keepalives interleaved. When the
/// request deadline passes first, the stream ends with `deadline_exceeded` instead of `end`,
/// which the SDKs turn into their timeout error (as with envd).
fn process_stream<T: Send + 'static>(
    pid: u32,
    rx: mpsc::Receiver<ProcessOutput>,
    keepalive: Option<Duration>,
    deadline: Option<std::time::Instant>,
    wrap: fn(pp::ProcessEvent) -> T,
) -> ServiceStream<T> {
    let state = EventStreamState {
        pid,
        rx,
        keepalive: keepalive_timer(keepalive),
        deadline: deadline.map(tokio::time::Instant::from_std),
        started: false,
        finished: false,
        wrap,
    };
    Box::pin(futures_util::stream::unfold(state, |mut st| async move {
        if st.finished {
            return None;
        }
        if !st.started {
            st.started = true;
            let start = event(pp::process_event::StartEvent {
                pid: st.pid,
                ..Default::default()
            });
            return Some((Ok((st.wrap)(start)), st));
        }
        let deadline = st.deadline;
        let expired = async move {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let keepalive = st.keepalive.as_mut();
        let tick = async move {
            match keepalive {
                Some(timer) => {
                    timer.tick().await;
                }
                None => std::future::pending().await,
            }
        };
        let next = tokio::select! {
            biased;
            _ = expired => {
                st.finished = true;
                let err = ConnectError::deadline_exceeded(format!(
                    "process {} did not finish before the request deadline and was killed",
                    st.pid
                ));
                return Some((Err(err), st));
            }
            output = st.rx.recv() => output,
            _ = tick => {
                let ping = event(pp::process_event::KeepAlive::default());
                return Some((Ok((st.wrap)(ping)), st));
            }
        };
        match next {
            Some(output) => {
                st.finished = matches!(output, ProcessOutput::End(_));
                Some((Ok((st.wrap)(output_event(output))), st))
            }
            None => {
                st.finished = true;
                let err = ConnectError::internal(format!(
                    "output of process {} ended without an exit status",
                    st.pid
                ));
                Some((Err(err), st))
            }
        }
    }))
}

fn start_response(e: pp::ProcessEvent) -> pp::StartResponse {
    pp::StartResponse {
        event: MessageField::some(e),
        ..Default::default()
    }
}

fn connect_response(e: pp::ProcessEvent) -> pp::ConnectResponse {
    pp::ConnectResponse {
        event: MessageField::some(e),
        ..Default::default()
    }
}

fn build_env(
    config_env: &std::collections::BTreeMap<String, String>,
    user: &User,
    request_env: impl IntoIterator<Item = (String, String)>,
) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), DEFAULT_PATH.into()),
        ("HOME".into(), user.home.to_string_lossy().into_owned()),
        ("USER".into(), user.name.clone()),
        ("LOGNAME".into(), user.name.clone()),
        ("SHELL".into(), user.shell.clone()),
    ];
    let mut set = |k: String, v: String| {
        if let Some(slot) = env.iter_mut().find(|(key, _)| *key == k) {
            slot.1 = v;
        } else {
            env.push((k, v));
        }
    };
    for (k, v) in config_env {
        set(k.clone(), v.clone());
    }
    let mut request_env: Vec<_> = request_env.into_iter().collect();
    request_env.sort();
    for (k, v) in request_env {
        set(k, v);
    }
    env
}

// The trait allows any encodable response; returning the concrete messages is intended.
#[allow(refining_impl_trait)]
impl Process for Services {
    async fn list(
        &self,
        _ctx: RequestContext,
        _request: ServiceRequest<'_, pp::ListRequest>,
    ) -> ServiceResult<pp::ListResponse> {
        let processes = self
            .state
            .processes
            .list()
            .into_iter()
            .map(|p| pp::ProcessInfo {
                config: MessageField::some(p.config.clone()),
                pid: p.pid,
                tag: p.tag.clone(),
                ..Default::default()
            })
            .collect();
        Response::ok(pp::ListResponse {
            processes,
            ..Default::default()
        })
    }

    async fn connect(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, pp::ConnectRequest>,
    ) -> ServiceResult<ServiceStream<pp::ConnectResponse>> {
        let request = request.to_owned_message();
        let process = self.process(request.process.as_option())?;
        let rx = process.subscribe();
        Ok(Response::new(process_stream(
            process.pid,
            rx,
            keepalive_interval(ctx.headers()),
            None,
            connect_response,
        )))
    }

    async fn start(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, pp::StartRequest>,
    ) -> ServiceResult<ServiceStream<pp::StartResponse>> {
        let request = request.to_owned_message();
        let (user, accounts) = self.user(ctx.headers())?;
        let config = request
            .process
            .as_option()
            .cloned()
            .ok_or_else(|| ConnectError::invalid_argument("process config is required"))?;
        if config.cmd.is_empty() {
            return Err(ConnectError::invalid_argument("process cmd is required"));
        }
        let cwd = match config.cwd.as_deref().filter(|c| !c.is_empty()) {
            Some(cwd) => resolve_path(cwd, &user),
            None => self
                .state
                .config()
                .default_workdir
                .as_deref()
                .map(std::path::PathBuf::from)
                .filter(|dir| dir.is_dir())
                .unwrap_or_else(|| user.home.clone()),
        };
        if !cwd.is_dir() {
            return Err(ConnectError::invalid_argument(format!(
                "cwd '{}' does not exist or is not a directory",
                cwd.display()
            )));
        }
        let pty = request.pty.as_option().map(|pty| {
            let size = pty.size.as_option();
            let dim =
                |v: u32, default: u16| u16::try_from(v).ok().filter(|v| *v > 0).unwrap_or(default);
            PtySize {
                cols: dim(size.map_or(0, |s| s.cols), 80),
                rows: dim(size.map_or(0, |s| s.rows), 24),
            }
        });
        let env = build_env(
            &self.state.config().env_vars,
            &user,
            config.envs.iter().map(|(k, v)| (k.clone(), v.clone())),
        );
        let spec = SpawnSpec {
            // The SDKs wrap every command in `/bin/bash -l -c`; images without bash (busybox,
            // alpine) still run them with their POSIX shell.
            cmd: if config.cmd == "/bin/bash" && !std::path::Path::new("/bin/bash").exists() {
                "/bin/sh".to_owned()
            } else {
                config.cmd.clone()
            },
            args: config.args.clone(),
            env,
            cwd,
            groups: accounts.group_ids(&user),
            user,
            pty,
            // envd keeps stdin open when the field is absent (older SDKs rely on it).
            stdin: request.stdin.unwrap_or(true),
            tag: request.tag.clone(),
            config,
        };
        let (process, rx) = self.state.processes.start(spec).map_err(process_error)?;
        // The request deadline bounds the process's life, as in envd; the stream itself is
        // ended with `deadline_exceeded` by the Connect layer.
        if let Some(deadline) = ctx.deadline() {
            let process = process.clone();
            tokio::spawn(async move {
                tokio::select! {
                    _ = tokio::time::sleep_until(tokio::time::Instant::from_std(deadline)) => {
                        let _ = process.signal(libc::SIGKILL);
                    }
                    _ = process.wait_done() => {}
                }
            });
        }
        Ok(Response::new(process_stream(
            process.pid,
            rx,
            keepalive_interval(ctx.headers()),
            ctx.deadline(),
            start_response,
        )))
    }

    async fn update(
        &self,
        _ctx: RequestContext,
        request: ServiceRequest<'_, pp::UpdateRequest>,
    ) -> ServiceResult<pp::UpdateResponse> {
        let request = request.to_owned_message();
        let process = self.process(request.process.as_option())?;
        if let Some(size) = request.pty.as_option().and_then(|p| p.size.as_option()) {
            let cols = u16::try_from(size.cols).unwrap_or(u16::MAX);
            let rows = u16::try_from(size.rows).unwrap_or(u16::MAX);
            process
                .resize(PtySize { cols, rows })
                .map_err(process_error)?;
        }
        Response::ok(pp::UpdateResponse::default())
    }

    async fn stream_input(
        &self,
        _ctx: RequestContext,
        mut requests: InboundStream<pp::StreamInputRequest>,
    ) -> ServiceResult<pp::StreamInputResponse> {
        use pp::__buffa::oneof::stream_input_request::Event;
        let mut process = None;
        while let Some(message) = requests.next().await {
            let message = message?.to_owned_message();
            match message.event {
                Some(Event::Start(start)) => {
                    process = Some(self.process(start.process.as_option())?);
                }
                Some(Event::Data(data)) => {
                    let process = process.as_ref().ok_or_else(|| {
                        ConnectError::failed_precondition("input sent before the start message")
                    })?;
                    write_input(process, data.input.as_option()).await?;
                }
                Some(Event::Keepalive(_)) | None => {}
            }
        }
        Response::ok(pp::StreamInputResponse::default())
    }

    async fn send_input(
        &self,
        _ctx: RequestContext,
        request: ServiceRequest<'_, pp::SendInputRequest>,
    ) -> ServiceResult<pp::SendInputResponse> {
        let request = request.to_owned_message();
        let process = self.process(request.process.as_option())?;
        write_input(&process, request.input.as_option()).await?;
        Response::ok(pp::SendInputResponse::default())
    }

    async fn send_signal(
        &self,
        _ctx: RequestContext,
        request: ServiceRequest<'_, pp::SendSignalRequest>,
    ) -> ServiceResult<pp::SendSignalResponse> {
        let request = request.to_owned_message();
        let process = self.process(request.process.as_option())?;
        let signal = match request.signal.as_known() {
            Some(pp::Signal::SIGNAL_SIGKILL) => libc::SIGKILL,
            Some(pp::Signal::SIGNAL_SIGTERM) => libc::SIGTERM,
            _ => return Err(ConnectError::invalid_argument("unsupported signal")),
        };
        process.signal(signal).map_err(process_error)?;
        Response::ok(pp::SendSignalResponse::default())
    }

    async fn close_stdin(
        &self,
        _ctx: RequestContext,
        request: ServiceRequest<'_, pp::CloseStdinRequest>,
    ) -> ServiceResult<pp::CloseStdinResponse> {
        let request = request.to_owned_message();
        let process = self.process(request.process.as_option())?;
        process.close_stdin().await.map_err(process_error)?;
        Response::ok(pp::CloseStdinResponse::default())
    }
}

async fn write_input(
    process: &crate::process::ManagedProcess,
    input: Option<&pp::ProcessInput>,
) -> Result<(), ConnectError> {
    use pp::__buffa::oneof::process_input::Input;
    match input.and_then(|i| i.input.as_ref()) {
        Some(Input::Stdin(bytes)) => process.write_stdin(bytes).await,
        Some(Input::Pty(bytes)) => process.write_pty(bytes).await,
        None => Ok(()),
    }
    .map_err(process_error)
}

fn watch_stream(
    mut rx: mpsc::Receiver<fsp::FilesystemEvent>,
    keepalive: Option<Duration>,
) -> ServiceStream<fsp::WatchDirResponse> {
    use fsp::__buffa::oneof::watch_dir_response::Event;
    let respond = |e: Event| {
        Ok(fsp::WatchDirResponse {
            event: Some(e),
            ..Default::default()
        })
    };
    let mut timer = keepalive_timer(keepalive);
    let stream = async_stream_like(move |tx| async move {
        if tx
            .send(respond(Event::from(
                fsp::watch_dir_response::StartEvent::default(),
            )))
            .await
            .is_err()
        {
            return;
        }
        loop {
            let tick = async {
                match timer.as_mut() {
                    Some(t) => {
                        t.tick().await;
                    }
                    None => std::future::pending().await,
                }
            };
            // Watching stops as soon as the client goes away, even when nothing changes.
            let item = tokio::select! {
                _ = tx.closed() => return,
                ev = rx.recv() => ev.map(Event::from),
                _ = tick => Some(Event::from(fsp::watch_dir_response::KeepAlive::default())),
            };
            let Some(item) = item else { return };
            if tx.send(respond(item)).await.is_err() {
                return;
            }
        }
    });
    Box::pin(stream)
}

/// Runs a producer task feeding a channel and exposes the channel as a stream; the task ends
/// when the consumer goes away.
fn async_stream_like<T, F, Fut>(producer: F) -> impl futures_util::Stream<Item = T> + Send
where
    T: Send + 'static,
    F: FnOnce(mpsc::Sender<T>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(producer(tx));
    futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|v| (v, rx)) })
}

#[allow(refining_impl_trait)]
impl Filesystem for Services {
    async fn stat(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, fsp::StatRequest>,
    ) -> ServiceResult<fsp::StatResponse> {
        let (user, accounts) = self.user(ctx.headers())?;
        let path = resolve_path(request.path, &user);
        let entry = crate::fs::stat(&path, &accounts).map_err(fs_error)?;
        Response::ok(fsp::StatResponse {
            entry: MessageField::some(entry),
            ..Default::default()
        })
    }

    async fn make_dir(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, fsp::MakeDirRequest>,
    ) -> ServiceResult<fsp::MakeDirResponse> {
        let (user, accounts) = self.user(ctx.headers())?;
        let path = resolve_path(request.path, &user);
        let entry = crate::fs::make_dir(&path, &user, &accounts).map_err(fs_error)?;
        Response::ok(fsp::MakeDirResponse {
            entry: MessageField::some(entry),
            ..Default::default()
        })
    }

    async fn r#move(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, fsp::MoveRequest>,
    ) -> ServiceResult<fsp::MoveResponse> {
        let (user, accounts) = self.user(ctx.headers())?;
        let source = resolve_path(request.source, &user);
        let destination = resolve_path(request.destination, &user);
        let entry = crate::fs::rename(&source, &destination, &user, &accounts).map_err(fs_error)?;
        Response::ok(fsp::MoveResponse {
            entry: MessageField::some(entry),
            ..Default::default()
        })
    }

    async fn list_dir(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, fsp::ListDirRequest>,
    ) -> ServiceResult<fsp::ListDirResponse> {
        let (user, accounts) = self.user(ctx.headers())?;
        let path = resolve_path(request.path, &user);
        let depth = request.depth;
        let entries = off_the_runtime(move || crate::fs::list_dir(&path, depth, &accounts)).await?;
        Response::ok(fsp::ListDirResponse {
            entries,
            ..Default::default()
        })
    }

    async fn remove(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, fsp::RemoveRequest>,
    ) -> ServiceResult<fsp::RemoveResponse> {
        let (user, _) = self.user(ctx.headers())?;
        let path = resolve_path(request.path, &user);
        off_the_runtime(move || crate::fs::remove(&path)).await?;
        Response::ok(fsp::RemoveResponse::default())
    }

    async fn watch_dir(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, fsp::WatchDirRequest>,
    ) -> ServiceResult<ServiceStream<fsp::WatchDirResponse>> {
        let (user, _) = self.user(ctx.headers())?;
        let path = resolve_path(request.path, &user);
        let rx = crate::watch::watch(WatchSpec {
            root: path,
            recursive: request.recursive,
            include_entry: request.include_entry,
            allow_network_mounts: request.allow_network_mounts,
        })
        .await
        .map_err(watch_error)?;
        Ok(Response::new(watch_stream(
            rx,
            keepalive_interval(ctx.headers()),
        )))
    }

    async fn create_watcher(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, fsp::CreateWatcherRequest>,
    ) -> ServiceResult<fsp::CreateWatcherResponse> {
        let (user, _) = self.user(ctx.headers())?;
        let path = resolve_path(request.path, &user);
        let watcher_id = self
            .state
            .watchers
            .create(WatchSpec {
                root: path,
                recursive: request.recursive,
                include_entry: request.include_entry,
                allow_network_mounts: request.allow_network_mounts,
            })
            .await
            .map_err(watcher_error)?;
        Response::ok(fsp::CreateWatcherResponse {
            watcher_id,
            ..Default::default()
        })
    }

    async fn get_watcher_events(
        &self,
        _ctx: RequestContext,
        request: ServiceRequest<'_, fsp::GetWatcherEventsRequest>,
    ) -> ServiceResult<fsp::GetWatcherEventsResponse> {
        let events = self
            .state
            .watchers
            .drain(request.watcher_id)
            .map_err(watcher_error)?;
        Response::ok(fsp::GetWatcherEventsResponse {
            events,
            ..Default::default()
        })
    }

    async fn remove_watcher(
        &self,
        _ctx: RequestContext,
        request: ServiceRequest<'_, fsp::RemoveWatcherRequest>,
    ) -> ServiceResult<fsp::RemoveWatcherResponse> {
        self.state
            .watchers
            .remove(request.watcher_id)
            .map_err(watcher_error)?;
        Response::ok(fsp::RemoveWatcherResponse::default())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn env_layers_override_in_order() {
        let user = User {
            name: "u".into(),
            uid: 1,
            gid: 1,
            home: "/home/u".into(),
            shell: "/bin/sh".into(),
        };
        let mut config = std::collections::BTreeMap::new();
        config.insert("A".to_owned(), "config".to_owned());
        config.insert("PATH".to_owned(), "/custom".to_owned());
        let env = build_env(&config, &user, [("A".to_owned(), "request".to_owned())]);
        let get = |k: &str| {
            env.iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(get("A"), Some("request"));
        assert_eq!(get("PATH"), Some("/custom"));
        assert_eq!(get("HOME"), Some("/home/u"));
        assert_eq!(get("USER"), Some("u"));
    }
}
