//! The HTTP API E2B's code interpreter SDKs call on port 49999: `/execute` streams an
//! execution's output as JSON lines, `/contexts` manages stateful kernels, `/health` answers
//! once the default Python kernel runs.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use bytes::Bytes;
use jupyter_protocol::JupyterMessageContent;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::kernel::{Kernel, KernelCommand, Replies};
use crate::output::{Output, map_message};
pub use crate::sandbox_env::SandboxEnv;

/// How often a quiet execution sends a keepalive line.
const KEEPALIVE: Duration = Duration::from_secs(1);
/// How long an interrupted execution may take to wind down before the next one may start.
const WIND_DOWN: Duration = Duration::from_secs(10);
/// How long the code that sets or restores per-execution variables may take.
const ENV_PATIENCE: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct Config {
    /// Working directory of the default contexts and of new ones that name none.
    pub default_cwd: String,
    /// Where kernels' connection files go.
    pub runtime_dir: PathBuf,
    /// How to start a kernel of each language.
    pub kernels: BTreeMap<String, KernelCommand>,
    /// Languages E2B's SDKs name that this template cannot run, and why; asking for one
    /// answers 400 with the reason.
    pub unavailable: BTreeMap<String, String>,
    /// The sandbox's environment variables as a JSON object, kept by the sandbox's agent.
    /// Kernels running since before the sandbox got them (restored from the template's
    /// capture) get them set before their next execution.
    pub sandbox_env: Option<PathBuf>,
}

#[derive(Debug)]
struct Context {
    id: String,
    language: String,
    cwd: String,
    /// Held for a whole execution: a context runs one at a time, in order. `None` in a
    /// default context whose language has not run yet.
    kernel: tokio::sync::Mutex<Option<Kernel>>,
}

impl Context {
    fn describe(&self) -> ContextInfo {
        ContextInfo {
            id: self.id.clone(),
            language: self.language.clone(),
            cwd: self.cwd.clone(),
        }
    }
}

#[derive(Debug)]
pub struct Server {
    config: Config,
    /// In the order they were made, as `GET /contexts` lists them: the default contexts
    /// first, then those created.
    contexts: std::sync::Mutex<Vec<Arc<Context>>>,
    /// The context each language's requests without a context run in: one for every
    /// language served, listed from the start (E2B's server lists Python's and JavaScript's
    /// at once), its kernel started on the language's first use (only Python's at once), so
    /// that an idle sandbox runs one kernel.
    defaults: tokio::sync::Mutex<HashMap<String, String>>,
    ready: AtomicBool,
}

#[derive(Debug, Serialize)]
struct ContextInfo {
    id: String,
    language: String,
    cwd: String,
}

/// Why the default kernel did not start.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct StartDefaultError(#[from] ApiError);

#[derive(Debug, thiserror::Error)]
enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Kernel(String),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Kernel(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        (status, self.to_string()).into_response()
    }
}

/// The language's canonical name, as E2B's server reports it in a context: `js` is
/// `javascript` and `ts` is `typescript`.
fn normalize_language(language: Option<&str>) -> String {
    match language.map(|l| l.trim().to_ascii_lowercase()) {
        None => "python".into(),
        Some(l) if l.is_empty() || l == "python3" => "python".into(),
        Some(l) if l == "sh" => "bash".into(),
        Some(l) if l == "js" || l == "node" => "javascript".into(),
        Some(l) if l == "ts" => "typescript".into(),
        Some(l) => l,
    }
}

fn new_context_id() -> String {
    let bytes = crate::kernel::fresh_bytes();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// The order of the default contexts in the list: E2B's server makes Python's and
/// JavaScript's first.
fn default_rank(language: &str) -> (usize, &str) {
    let rank = ["python", "javascript", "typescript"]
        .iter()
        .position(|l| *l == language)
        .unwrap_or(3);
    (rank, language)
}

impl Server {
    pub fn new(config: Config) -> Arc<Server> {
        let mut languages: Vec<&String> = config.kernels.keys().collect();
        languages.sort_by_key(|l| default_rank(l));
        let contexts: Vec<Arc<Context>> = languages
            .into_iter()
            .map(|language| {
                Arc::new(Context {
                    id: new_context_id(),
                    language: language.clone(),
                    cwd: config.default_cwd.clone(),
                    kernel: tokio::sync::Mutex::new(None),
                })
            })
            .collect();
        let defaults = contexts
            .iter()
            .map(|c| (c.language.clone(), c.id.clone()))
            .collect();
        Arc::new(Server {
            config,
            contexts: std::sync::Mutex::new(contexts),
            defaults: tokio::sync::Mutex::new(defaults),
            ready: AtomicBool::new(false),
        })
    }

    pub fn router(self: &Arc<Self>) -> axum::Router {
        axum::Router::new()
            .route("/health", get(health))
            .route("/execute", post(execute))
            .route("/contexts", post(create_context).get(list_contexts))
            .route("/contexts/{id}", delete(delete_context))
            .route("/contexts/{id}/restart", post(restart_context))
            .with_state(self.clone())
    }

    /// Starts the default Python kernel; `/health` answers 200 from then on.
    pub async fn start_default(self: &Arc<Self>) -> Result<(), StartDefaultError> {
        let context = self.default_context("python").await?;
        let mut kernel = context.kernel.lock().await;
        if kernel.is_none() {
            *kernel = Some(self.start_kernel(&context.language, &context.cwd).await?);
        }
        drop(kernel);
        self.ready.store(true, Ordering::Release);
        Ok(())
    }

    fn kernel_command(&self, language: &str) -> Result<&KernelCommand, ApiError> {
        self.config.kernels.get(language).ok_or_else(|| {
            let known: Vec<&str> = self.config.kernels.keys().map(String::as_str).collect();
            let why = self
                .config
                .unavailable
                .get(language)
                .map(|reason| format!(": {reason}"))
                .unwrap_or_default();
            ApiError::BadRequest(format!(
                "language '{language}' is not supported here{why} (supported: {})",
                known.join(", ")
            ))
        })
    }

    /// Starts a kernel with the sandbox's environment as it is now in its process's own:
    /// a kernel started after the sandbox got it (any but the default Python one) needs no
    /// code to set it. The kernel command's own variables come last, so a sandbox's cannot
    /// undo what the kernel needs.
    async fn start_kernel(&self, language: &str, cwd: &str) -> Result<Kernel, ApiError> {
        let mut command = self.kernel_command(language)?.clone();
        let sandbox_env = self
            .config
            .sandbox_env
            .as_deref()
            .and_then(read_sandbox_env);
        if let Some(env) = &sandbox_env {
            let own = std::mem::take(&mut command.env);
            command.env = env
                .vars
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .chain(own)
                .collect();
        }
        let mut kernel = Kernel::start(
            &command,
            std::path::Path::new(cwd),
            &self.config.runtime_dir,
        )
        .await
        .map_err(|e| ApiError::Kernel(e.to_string()))?;
        // A JVM's system properties hold the variables too (E2B's tests read them with
        // `System.getProperty`): they are set by code, at the kernel's first execution.
        if sandbox_env_code_needed_at_start(language) {
            kernel.sandbox_env = None;
        } else {
            kernel.sandbox_env = sandbox_env;
        }
        Ok(kernel)
    }

    async fn new_context(&self, language: &str, cwd: &str) -> Result<Arc<Context>, ApiError> {
        self.kernel_command(language)?;
        if !std::path::Path::new(cwd).is_dir() {
            return Err(ApiError::BadRequest(format!(
                "the working directory {cwd} does not exist"
            )));
        }
        let kernel = self.start_kernel(language, cwd).await?;
        let context = Arc::new(Context {
            id: new_context_id(),
            language: language.to_owned(),
            cwd: cwd.to_owned(),
            kernel: tokio::sync::Mutex::new(Some(kernel)),
        });
        self.contexts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(context.clone());
        Ok(context)
    }

    fn context(&self, id: &str) -> Option<Arc<Context>> {
        self.contexts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|c| c.id == id)
            .cloned()
    }

    /// The language's default context; one removed is made again, its kernel started by
    /// its first execution.
    async fn default_context(&self, language: &str) -> Result<Arc<Context>, ApiError> {
        self.kernel_command(language)?;
        let mut defaults = self.defaults.lock().await;
        if let Some(context) = defaults.get(language).and_then(|id| self.context(id)) {
            return Ok(context);
        }
        let context = Arc::new(Context {
            id: new_context_id(),
            language: language.to_owned(),
            cwd: self.config.default_cwd.clone(),
            kernel: tokio::sync::Mutex::new(None),
        });
        self.contexts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(context.clone());
        defaults.insert(language.to_owned(), context.id.clone());
        Ok(context)
    }
}

async fn health(State(server): State<Arc<Server>>) -> Response {
    if server.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "OK").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting").into_response()
    }
}

#[derive(Debug, Deserialize)]
struct CreateContext {
    language: Option<String>,
    cwd: Option<String>,
}

async fn create_context(
    State(server): State<Arc<Server>>,
    body: Option<Json<CreateContext>>,
) -> Result<Json<ContextInfo>, ApiError> {
    let (language, cwd) = match body {
        Some(Json(b)) => (b.language, b.cwd),
        None => (None, None),
    };
    let language = normalize_language(language.as_deref());
    let cwd = cwd
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| server.config.default_cwd.clone());
    let context = server.new_context(&language, &cwd).await?;
    Ok(Json(context.describe()))
}

async fn list_contexts(State(server): State<Arc<Server>>) -> Json<Vec<ContextInfo>> {
    let contexts = server.contexts.lock().unwrap_or_else(|e| e.into_inner());
    Json(contexts.iter().map(|c| c.describe()).collect())
}

async fn delete_context(
    State(server): State<Arc<Server>>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let context = {
        let mut contexts = server.contexts.lock().unwrap_or_else(|e| e.into_inner());
        let at = contexts
            .iter()
            .position(|c| c.id == id)
            .ok_or_else(|| ApiError::NotFound(format!("context {id} not found")))?;
        contexts.remove(at)
    };
    if let Some(kernel) = context.kernel.lock().await.take() {
        kernel.shutdown().await;
    }
    Ok(StatusCode::NO_CONTENT)
}

async fn restart_context(
    State(server): State<Arc<Server>>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let context = server
        .context(&id)
        .ok_or_else(|| ApiError::NotFound(format!("context {id} not found")))?;
    let mut kernel = context.kernel.lock().await;
    if let Some(old) = kernel.take() {
        old.shutdown().await;
    }
    *kernel = Some(server.start_kernel(&context.language, &context.cwd).await?);
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
struct ExecuteRequest {
    code: String,
    context_id: Option<String>,
    language: Option<String>,
    env_vars: Option<BTreeMap<String, String>>,
}

fn valid_env_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == b'_')
        && bytes.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

async fn execute(
    State(server): State<Arc<Server>>,
    Json(request): Json<ExecuteRequest>,
) -> Result<Response, ApiError> {
    let context = match (&request.context_id, &request.language) {
        (Some(_), Some(_)) => {
            return Err(ApiError::BadRequest(
                "only one of context_id and language may be given".into(),
            ));
        }
        (Some(id), None) => server
            .context(id)
            .ok_or_else(|| ApiError::NotFound(format!("context {id} not found")))?,
        (None, language) => {
            server
                .default_context(&normalize_language(language.as_deref()))
                .await?
        }
    };
    let env = request.env_vars.unwrap_or_default();
    if let Some(bad) = env.keys().find(|k| !valid_env_name(k)) {
        return Err(ApiError::BadRequest(format!(
            "'{bad}' is not a valid environment variable name"
        )));
    }
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(64);
    tokio::spawn(run_execution(server, context, request.code, env, tx));
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], body).into_response())
}

async fn send_line(tx: &mpsc::Sender<Result<Bytes, Infallible>>, output: &Output) -> bool {
    tx.send(Ok(Bytes::from(output.to_line()))).await.is_ok()
}

/// Runs one execution to its end, streaming its lines; a client that goes away interrupts it.
async fn run_execution(
    server: Arc<Server>,
    context: Arc<Context>,
    code: String,
    env: BTreeMap<String, String>,
    tx: mpsc::Sender<Result<Bytes, Infallible>>,
) {
    let mut guard = context.kernel.lock().await;
    if !guard.as_mut().is_some_and(Kernel::is_alive) {
        // A kernel that exited (the code ended its process, or it ran out of memory) is
        // replaced, as a Jupyter server restarts a dead kernel: the state is gone, the
        // context goes on. A default context's kernel starts here at its first use.
        match guard.take() {
            Some(dead) => {
                dead.shutdown().await;
                tracing::warn!(context = %context.id, "the context's kernel is not running; starting a new one");
            }
            None => {
                tracing::info!(context = %context.id, language = %context.language, "starting the context's kernel");
            }
        }
        match server.start_kernel(&context.language, &context.cwd).await {
            Ok(kernel) => *guard = Some(kernel),
            Err(e) => {
                let _ = send_line(
                    &tx,
                    &Output::Error {
                        name: "KernelError".into(),
                        value: format!("the context's kernel cannot start: {e}"),
                        traceback: String::new(),
                    },
                )
                .await;
                let _ = send_line(&tx, &Output::EndOfExecution).await;
                return;
            }
        }
    }
    let Some(kernel) = guard.as_mut() else {
        return;
    };
    if let Some(path) = &server.config.sandbox_env
        && let Some(sandbox_env) = read_sandbox_env(path)
        && kernel.sandbox_env.as_ref() != Some(&sandbox_env)
    {
        match sandbox_env_code(&context.language, &sandbox_env.vars) {
            Some(set) => {
                if let Err(e) = run_silent(kernel, set).await {
                    let _ = send_line(&tx, &e).await;
                    let _ = send_line(&tx, &Output::EndOfExecution).await;
                    return;
                }
            }
            None => tracing::warn!(
                context = %context.id,
                language = %context.language,
                "the sandbox's environment changed, and this kernel cannot take it; it keeps the one it started with"
            ),
        }
        kernel.sandbox_env = Some(sandbox_env);
    }
    let restore = if env.is_empty() {
        None
    } else {
        let Some((set, restore)) = env_code(&context.language, &env) else {
            let _ = send_line(
                &tx,
                &Output::Error {
                    name: "EnvironmentError".into(),
                    value: format!(
                        "a {} kernel cannot take environment variables for one execution",
                        context.language
                    ),
                    traceback: String::new(),
                },
            )
            .await;
            let _ = send_line(&tx, &Output::EndOfExecution).await;
            return;
        };
        if let Err(e) = run_silent(kernel, set).await {
            let _ = send_line(&tx, &e).await;
            let _ = send_line(&tx, &Output::EndOfExecution).await;
            return;
        }
        Some(restore)
    };
    match kernel.execute(code, false).await {
        Ok(replies) => stream_execution(kernel, replies, &tx).await,
        Err(e) => {
            let _ = send_line(
                &tx,
                &Output::Error {
                    name: "KernelError".into(),
                    value: e.to_string(),
                    traceback: String::new(),
                },
            )
            .await;
        }
    }
    // A kernel that died took the variables with it.
    if let Some(restore) = restore
        && kernel.is_alive()
    {
        let _ = run_silent(kernel, restore).await;
    }
    let _ = send_line(&tx, &Output::EndOfExecution).await;
}

async fn stream_execution(
    kernel: &mut Kernel,
    mut replies: Replies,
    tx: &mpsc::Sender<Result<Bytes, Infallible>>,
) {
    let mut client_gone = false;
    let mut wind_down = None;
    loop {
        let deadline = wind_down.unwrap_or_else(|| tokio::time::Instant::now() + WIND_DOWN);
        tokio::select! {
            message = replies.recv() => {
                let Some(message) = message else { break };
                let (output, done) = map_message(&message);
                if let Some(output) = output
                    && !client_gone
                    && !send_line(tx, &output).await
                {
                    client_gone = true;
                }
                if done {
                    break;
                }
            }
            () = tokio::time::sleep(KEEPALIVE) => {
                if !kernel.is_alive() {
                    let _ = send_line(tx, &Output::Error {
                        name: "KernelDied".into(),
                        value: "the kernel exited during the execution; the context's next \
                                execution starts a new one"
                            .into(),
                        traceback: String::new(),
                    })
                    .await;
                    break;
                }
                if !client_gone && !send_line(tx, &Output::Keepalive).await {
                    client_gone = true;
                }
            }
            () = tx.closed(), if !client_gone => {
                client_gone = true;
            }
            () = tokio::time::sleep_until(deadline), if wind_down.is_some() => {
                tracing::warn!("an interrupted execution did not end in time");
                break;
            }
        }
        if client_gone && wind_down.is_none() {
            tracing::info!("the client left; interrupting the execution");
            kernel.interrupt();
            wind_down = Some(tokio::time::Instant::now() + WIND_DOWN);
        }
    }
    kernel.forget(replies.id());
}

/// Runs code that prints nothing; its error, if any, as the line to answer with.
async fn run_silent(kernel: &Kernel, code: String) -> Result<(), Output> {
    let fail = |value: String| Output::Error {
        name: "EnvironmentError".into(),
        value,
        traceback: String::new(),
    };
    let mut replies = kernel
        .execute(code, true)
        .await
        .map_err(|e| fail(e.to_string()))?;
    let mut error = None;
    let waited = tokio::time::timeout(ENV_PATIENCE, async {
        while let Some(message) = replies.recv().await {
            match &message.content {
                JupyterMessageContent::ErrorOutput(e) => {
                    error = Some(fail(format!("{}: {}", e.ename, e.evalue)));
                }
                JupyterMessageContent::ExecuteReply(reply)
                    if reply.status != jupyter_protocol::ReplyStatus::Ok =>
                {
                    error.get_or_insert_with(|| fail("setting the variables failed".into()));
                }
                _ => {}
            }
            if map_message(&message).1 {
                break;
            }
        }
    })
    .await;
    kernel.forget(replies.id());
    if waited.is_err() {
        return Err(fail("setting the variables timed out".into()));
    }
    error.map_or(Ok(()), Err)
}

/// The sandbox's environment as its agent last wrote it, and when it wrote it; `None` when
/// there is none to read (outside a sandbox) or it is not a JSON object of strings.
fn read_sandbox_env(path: &std::path::Path) -> Option<SandboxEnv> {
    let file = std::fs::File::open(path).ok()?;
    let written = file.metadata().and_then(|m| m.modified()).ok()?;
    let env: BTreeMap<String, String> = serde_json::from_reader(std::io::BufReader::new(file))
        .map_err(|e| tracing::warn!(path = %path.display(), error = %e, "unreadable sandbox environment"))
        .ok()?;
    let vars = env.into_iter().filter(|(k, _)| valid_env_name(k)).collect();
    Some(SandboxEnv { written, vars })
}

/// Code that sets the sandbox's `env` in a kernel for good. The agent writes it when the
/// sandbox gets its identity, also when a kernel restored from the template's capture runs
/// on: Python's generators seeded before the capture are seeded again, or every sandbox of
/// the template would draw the same numbers.
fn sandbox_env_code(language: &str, env: &BTreeMap<String, String>) -> Option<String> {
    match language {
        // One statement that is both JavaScript and TypeScript (tslab type-checks it).
        "javascript" | "typescript" => {
            return Some(format!(
                "Object.assign(process.env, {});\n",
                json_object(env)
            ));
        }
        "r" => {
            return Some(format!(
                "invisible(do.call(Sys.setenv, {}))\n",
                r_named_list(env.iter())
            ));
        }
        "java" => {
            return Some(format!(
                "{{\n{}{JAVA_WRITABLE_ENV}  for (java.util.Map.Entry<String, String> var : vars.entrySet()) {{\n    \
                 if (writable != null) writable.put(var.getKey(), var.getValue());\n    \
                 System.setProperty(var.getKey(), var.getValue());\n  }}\n}}\n",
                java_vars(env)
            ));
        }
        "python" | "bash" => {}
        _ => return None,
    }
    if language == "bash" {
        let mut code: String = env
            .iter()
            .map(|(name, value)| format!("export {name}={}\n", shell_quote(value)))
            .collect();
        code.push_str("RANDOM=$(( $(od -An -N2 -tu2 /dev/urandom) ))\n");
        return Some(code);
    }
    let values = serde_json::to_string(env).unwrap_or_else(|_| "{}".into());
    Some(format!(
        "import os as _sandbar_os, random as _sandbar_random, sys as _sandbar_sys\n\
         _sandbar_os.environ.update({values})\n\
         _sandbar_random.seed()\n\
         if 'numpy.random' in _sandbar_sys.modules:\n    \
         _sandbar_sys.modules['numpy.random'].seed()\n\
         del _sandbar_os, _sandbar_random, _sandbar_sys\n"
    ))
}

/// Code that sets `env` in a kernel for one execution, and code that puts back what was
/// there before.
fn env_code(language: &str, env: &BTreeMap<String, String>) -> Option<(String, String)> {
    match language {
        // Valid JavaScript and TypeScript alike: no annotations, nothing a type check
        // refuses, and nothing declared at the top level, where it would be the user's. The
        // restoring closure is kept on `process` under a name of its own.
        "javascript" | "typescript" => {
            let set = format!(
                "{{\n  const vars = {};\n  \
                 const saved = Object.keys(vars).map((k) => ({{ k, v: process.env[k] }}));\n  \
                 Object.assign(process.env, vars);\n  \
                 Reflect.set(process, \"__sandbarRestoreEnv\", () => {{\n    \
                 for (const s of saved) {{\n      \
                 if (s.v === undefined) delete process.env[s.k];\n      \
                 else process.env[s.k] = s.v;\n    }}\n  }});\n}}\n",
                json_object(env)
            );
            let restore = "{\n  const restore = Reflect.get(process, \"__sandbarRestoreEnv\");\n  \
                           Reflect.deleteProperty(process, \"__sandbarRestoreEnv\");\n  \
                           if (typeof restore === \"function\") restore();\n}\n"
                .to_owned();
            return Some((set, restore));
        }
        // The earlier values wait in an option, out of the user's workspace; NA is unset.
        "r" => {
            let names: Vec<String> = env.keys().map(String::as_str).map(json_string).collect();
            let set = format!(
                "local({{\n  \
                 options(sandbar.saved_env = Sys.getenv(c({}), unset = NA, names = TRUE))\n  \
                 do.call(Sys.setenv, {})\n}})\n",
                names.join(", "),
                r_named_list(env.iter())
            );
            let restore = "local({\n  \
                           saved <- getOption(\"sandbar.saved_env\")\n  \
                           options(sandbar.saved_env = NULL)\n  \
                           for (name in names(saved)) {\n    \
                           if (is.na(saved[[name]])) Sys.unsetenv(name)\n    \
                           else do.call(Sys.setenv, stats::setNames(list(saved[[name]]), name))\n  }\n\
                           })\n"
                .to_owned();
            return Some((set, restore));
        }
        // The earlier values (of the environment and of the system properties) wait in the
        // system properties under a key of their own, as an object no `getProperty` shows.
        "java" => {
            let set = format!(
                "{{\n{}{JAVA_WRITABLE_ENV}  java.util.Map<String, String[]> saved = new java.util.HashMap<>();\n  \
                 for (java.util.Map.Entry<String, String> var : vars.entrySet()) {{\n    \
                 String k = var.getKey();\n    \
                 saved.put(k, new String[] {{System.getenv(k), System.getProperty(k)}});\n    \
                 if (writable != null) writable.put(k, var.getValue());\n    \
                 System.setProperty(k, var.getValue());\n  }}\n  \
                 System.getProperties().put(\"{JAVA_SAVED_KEY}\", saved);\n}}\n",
                java_vars(env)
            );
            let restore = format!(
                "{{\n{JAVA_WRITABLE_ENV}  Object stash = System.getProperties().remove(\"{JAVA_SAVED_KEY}\");\n  \
                 if (stash instanceof java.util.Map) {{\n    \
                 @SuppressWarnings(\"unchecked\")\n    \
                 java.util.Map<String, String[]> saved = (java.util.Map<String, String[]>) stash;\n    \
                 for (java.util.Map.Entry<String, String[]> entry : saved.entrySet()) {{\n      \
                 String k = entry.getKey();\n      \
                 String[] was = entry.getValue();\n      \
                 if (writable != null) {{\n        \
                 if (was[0] == null) writable.remove(k);\n        \
                 else writable.put(k, was[0]);\n      }}\n      \
                 if (was[1] == null) System.clearProperty(k);\n      \
                 else System.setProperty(k, was[1]);\n    }}\n  }}\n}}\n"
            );
            return Some((set, restore));
        }
        "python" | "bash" => {}
        _ => return None,
    }
    if language == "bash" {
        let mut set = String::new();
        let mut restore = String::new();
        for (name, value) in env {
            set.push_str(&format!(
                "_sandbar_had_{name}=${{{name}+1}}; _sandbar_old_{name}=\"${{{name}-}}\"; export {name}={}\n",
                shell_quote(value)
            ));
            restore.push_str(&format!(
                "if [ -n \"$_sandbar_had_{name}\" ]; then export {name}=\"$_sandbar_old_{name}\"; else unset {name}; fi; unset _sandbar_had_{name} _sandbar_old_{name}\n"
            ));
        }
        return Some((set, restore));
    }
    // A JSON object of strings is also a Python dict literal.
    let values = serde_json::to_string(env).unwrap_or_else(|_| "{}".into());
    let set = format!(
        "import os as _sandbar_os\n\
         _sandbar_saved_env = {{k: _sandbar_os.environ.get(k) for k in {values}}}\n\
         _sandbar_os.environ.update({values})\n"
    );
    let restore = "for _sandbar_k, _sandbar_v in _sandbar_saved_env.items():\n    \
                   if _sandbar_v is None:\n        _sandbar_os.environ.pop(_sandbar_k, None)\n    \
                   else:\n        _sandbar_os.environ[_sandbar_k] = _sandbar_v\n\
                   del _sandbar_saved_env, _sandbar_k, _sandbar_v\n"
        .to_owned();
    Some((set, restore))
}

/// Where a Java kernel keeps the values an execution's variables replace.
const JAVA_SAVED_KEY: &str = "sandbar.saved-env";

/// Java statements that declare `writable`: the map behind `System.getenv()` (and what a
/// `ProcessBuilder` starts with), or null where the JVM does not open `java.util` to the
/// kernel's code (see the Java kernel's `JJAVA_JVM_OPTS`). Inside a block, so nothing is
/// declared where the user's code would see it.
const JAVA_WRITABLE_ENV: &str = "  java.util.Map<String, String> writable = null;\n  \
     try {\n    \
     java.util.Map<String, String> env = System.getenv();\n    \
     java.lang.reflect.Field field = env.getClass().getDeclaredField(\"m\");\n    \
     field.setAccessible(true);\n    \
     @SuppressWarnings(\"unchecked\")\n    \
     java.util.Map<String, String> inner = (java.util.Map<String, String>) field.get(env);\n    \
     writable = inner;\n  \
     } catch (Exception ignored) {\n  }\n";

/// `vars`, a Java map of `env` declared in a block. A JSON string is also a Java string
/// literal: serde_json writes `\"`, `\\`, `\n`, `\r` and `\t` as such, never `\u` escapes of
/// a quote, a backslash or a line end, which Java would read before the literal.
fn java_vars(env: &BTreeMap<String, String>) -> String {
    let mut code =
        "  java.util.Map<String, String> vars = new java.util.LinkedHashMap<>();\n".to_owned();
    for (name, value) in env {
        code.push_str(&format!(
            "  vars.put({}, {});\n",
            json_string(name),
            json_string(value)
        ));
    }
    code
}

/// Whether a kernel started with the sandbox's environment in its process still needs the
/// code of [`sandbox_env_code`] run: a JVM keeps the variables in its system properties too.
fn sandbox_env_code_needed_at_start(language: &str) -> bool {
    language == "java"
}

fn json_object(env: &BTreeMap<String, String>) -> String {
    serde_json::to_string(env).unwrap_or_else(|_| "{}".into())
}

/// A string as a double-quoted literal: JSON's escapes (`\"`, `\\`, `\n`, `\uXXXX`, ...) are
/// also R's and JavaScript's.
fn json_string(value: &str) -> String {
    serde_json::to_string(value).unwrap_or_else(|_| "\"\"".into())
}

/// `list(NAME = "value", ...)` in R; names are checked environment variable names, quoted
/// with backticks since one may start with `_`.
fn r_named_list<'a>(env: impl Iterator<Item = (&'a String, &'a String)>) -> String {
    let items: Vec<String> = env
        .map(|(name, value)| format!("`{name}` = {}", json_string(value)))
        .collect();
    format!("list({})", items.join(", "))
}

fn shell_quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', "'\\''"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn languages_are_normalized() {
        assert_eq!(normalize_language(None), "python");
        assert_eq!(normalize_language(Some(" Python ")), "python");
        assert_eq!(normalize_language(Some("python3")), "python");
        assert_eq!(normalize_language(Some("bash")), "bash");
        assert_eq!(normalize_language(Some("r")), "r");
        assert_eq!(normalize_language(Some("JS")), "javascript");
        assert_eq!(normalize_language(Some("ts")), "typescript");
        assert_eq!(normalize_language(Some("javascript")), "javascript");
    }

    #[test]
    fn the_sandbox_environment_is_read_and_set_for_good() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("env.json");
        assert_eq!(read_sandbox_env(&path), None);
        std::fs::write(&path, r#"{"A":"it's","B-C":"x"}"#).expect("write");
        let env = read_sandbox_env(&path).expect("env").vars;
        assert_eq!(env, BTreeMap::from([("A".to_owned(), "it's".to_owned())]));
        assert!(
            sandbox_env_code("bash", &env)
                .unwrap()
                .starts_with("export A='it'\\''s'\n")
        );
        let python = sandbox_env_code("python", &env).unwrap();
        assert!(
            python.contains(r#"environ.update({"A":"it's"})"#),
            "{python}"
        );
        assert!(python.contains("random.seed()"), "{python}");
        std::fs::write(&path, "not json").expect("write");
        assert_eq!(read_sandbox_env(&path), None);
    }

    #[test]
    fn env_names_are_checked() {
        assert!(valid_env_name("FOO_1"));
        assert!(valid_env_name("_x"));
        assert!(!valid_env_name("1X"));
        assert!(!valid_env_name("A-B"));
        assert!(!valid_env_name("A;rm"));
        assert!(!valid_env_name(""));
    }

    #[test]
    fn bash_values_are_quoted() {
        let env = BTreeMap::from([("A".to_owned(), "it's $HOME".to_owned())]);
        let (set, restore) = env_code("bash", &env).unwrap();
        assert!(set.contains("export A='it'\\''s $HOME'"), "{set}");
        assert!(restore.contains("unset A"), "{restore}");
    }

    #[test]
    fn python_values_are_a_dict_literal() {
        let env = BTreeMap::from([("A".to_owned(), "x\"y\n".to_owned())]);
        let (set, _) = env_code("python", &env).unwrap();
        assert!(set.contains(r#"{"A":"x\"y\n"}"#), "{set}");
    }

    #[test]
    fn js_and_ts_set_process_env_and_put_it_back() {
        let env = BTreeMap::from([("A".to_owned(), "it's \"x\"\n".to_owned())]);
        let (set, restore) = env_code("javascript", &env).unwrap();
        assert!(
            set.contains(r#"const vars = {"A":"it's \"x\"\n"};"#),
            "{set}"
        );
        assert!(set.contains("Object.assign(process.env, vars)"), "{set}");
        assert!(set.contains("delete process.env[s.k]"), "{set}");
        assert!(restore.contains("__sandbarRestoreEnv"), "{restore}");
        assert_eq!(env_code("typescript", &env).unwrap(), (set, restore));
        assert_eq!(
            sandbox_env_code("javascript", &env).unwrap(),
            "Object.assign(process.env, {\"A\":\"it's \\\"x\\\"\\n\"});\n"
        );
    }

    #[test]
    fn r_uses_sys_setenv_and_unsets_what_was_not_there() {
        let env = BTreeMap::from([
            ("A".to_owned(), "x\"y\\".to_owned()),
            ("_B".to_owned(), "2".to_owned()),
        ]);
        let (set, restore) = env_code("r", &env).unwrap();
        assert!(
            set.contains(r#"Sys.getenv(c("A", "_B"), unset = NA"#),
            "{set}"
        );
        assert!(
            set.contains(r#"do.call(Sys.setenv, list(`A` = "x\"y\\", `_B` = "2"))"#),
            "{set}"
        );
        assert!(restore.contains("Sys.unsetenv(name)"), "{restore}");
        assert!(restore.contains("sandbar.saved_env = NULL"), "{restore}");
        assert_eq!(
            sandbox_env_code("r", &env).unwrap(),
            "invisible(do.call(Sys.setenv, list(`A` = \"x\\\"y\\\\\", `_B` = \"2\")))\n"
        );
    }

    #[test]
    fn java_sets_the_environment_and_the_properties_and_puts_both_back() {
        let env = BTreeMap::from([("A".to_owned(), "it's \"x\"\n\\".to_owned())]);
        let (set, restore) = env_code("java", &env).unwrap();
        assert!(set.contains(r#"vars.put("A", "it's \"x\"\n\\");"#), "{set}");
        assert!(set.contains("getDeclaredField(\"m\")"), "{set}");
        assert!(
            set.contains("System.setProperty(k, var.getValue())"),
            "{set}"
        );
        assert!(set.contains(JAVA_SAVED_KEY), "{set}");
        assert!(restore.contains("System.clearProperty(k)"), "{restore}");
        assert!(restore.contains("writable.remove(k)"), "{restore}");
        assert!(restore.contains(JAVA_SAVED_KEY), "{restore}");
        // One block each: nothing is declared where the user's code would see it.
        for code in [&set, &restore] {
            assert!(code.starts_with("{\n") && code.ends_with("}\n"), "{code}");
        }
        let for_good = sandbox_env_code("java", &env).unwrap();
        assert!(
            for_good.contains("System.setProperty(var.getKey()"),
            "{for_good}"
        );
        assert!(!for_good.contains(JAVA_SAVED_KEY), "{for_good}");
        assert!(sandbox_env_code_needed_at_start("java"));
        assert!(!sandbox_env_code_needed_at_start("python"));
    }

    #[test]
    fn every_served_language_has_a_default_context_python_first() {
        let command = KernelCommand {
            argv: vec!["true".into()],
            env: Vec::new(),
            tcp: false,
            interrupt_by_message: false,
        };
        let kernels = ["bash", "java", "javascript", "python", "r", "typescript"]
            .into_iter()
            .map(|l| (l.to_owned(), command.clone()))
            .collect();
        let server = Server::new(Config {
            default_cwd: "/home/user".into(),
            runtime_dir: "/nonexistent".into(),
            kernels,
            unavailable: BTreeMap::new(),
            sandbox_env: None,
        });
        let listed: Vec<String> = server
            .contexts
            .lock()
            .unwrap()
            .iter()
            .map(|c| c.language.clone())
            .collect();
        assert_eq!(
            listed,
            ["python", "javascript", "typescript", "bash", "java", "r"]
        );
        // None of their kernels runs until used.
        assert!(
            server
                .contexts
                .lock()
                .unwrap()
                .iter()
                .all(|c| c.kernel.try_lock().unwrap().is_none())
        );
    }

    #[test]
    fn unsupported_languages_say_why() {
        let server = Server::new(Config {
            default_cwd: "/".into(),
            runtime_dir: "/nonexistent".into(),
            kernels: BTreeMap::new(),
            unavailable: BTreeMap::from([("java".to_owned(), "no JDK here".to_owned())]),
            sandbox_env: None,
        });
        let java = server.kernel_command("java").unwrap_err().to_string();
        assert!(
            java.contains("'java' is not supported here: no JDK here"),
            "{java}"
        );
        let cobol = server.kernel_command("cobol").unwrap_err().to_string();
        assert!(cobol.contains("'cobol' is not supported here ("), "{cobol}");
    }

    #[test]
    fn context_ids_look_like_uuids() {
        let id = new_context_id();
        assert_eq!(id.len(), 36);
        assert_eq!(id.matches('-').count(), 4);
    }
}
