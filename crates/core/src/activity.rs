//! What [`crate::Sandboxes`] records about its sandboxes beyond their state: each sandbox's
//! log (lifecycle events and agent lines) and each team's activity over time.
//!
//! Writes are batched: agent logs are read in whole lines by the periodic reaper, one
//! transaction per sandbox that wrote something, and team activity is counted in memory and
//! written once per bucket.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use tokio::sync::{Notify, watch};

use crate::builds::LogLevel;
use crate::lock;
use crate::model::{SandboxEvent, Team};
use crate::runtime::{AgentLogChunk, Runtime};
use crate::sandbox_logs::{SandboxLogEntry, SandboxLogQuery, SandboxLogsError, parse_agent_line};
use crate::store::Store;
use crate::team_metrics::{
    BUCKET_SECS, TeamMetric, TeamMetricBucket, TeamMetricMax, TeamMetricPoint, TeamMetricsError,
    fold, max_of, step_for,
};
use crate::webhooks::Webhooks;

/// How much of the logs and metrics is kept.
#[derive(Debug, Clone)]
pub struct ActivityConfig {
    /// Lines kept per sandbox; the oldest go first.
    pub log_lines_per_sandbox: u64,
    /// How long a sandbox's logs stay readable after it ended, and how long team metrics
    /// are kept.
    pub retention: Duration,
}

impl Default for ActivityConfig {
    fn default() -> Self {
        Self {
            log_lines_per_sandbox: 10_000,
            retention: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

/// Lifecycle events that may wait to be written; beyond it one is dropped (and logged)
/// rather than hold up the sandbox operation that made it.
const EVENTS_WAITING_MAX: usize = 10_000;
/// Most events written in one transaction.
const EVENTS_PER_WRITE: usize = 256;

/// Most bytes of one agent log read per round; the rest waits for the next round.
pub(crate) const AGENT_LOG_READ_MAX: usize = 256 * 1024;

/// One agent log to read in a round over all of them: from where.
#[derive(Debug, Clone)]
pub(crate) struct AgentLogRead {
    pub(crate) sandbox_id: String,
    pub(crate) offset: u64,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counter {
    concurrent: u32,
    starts: u32,
}

pub(crate) struct Activity {
    store: Arc<Store>,
    config: ActivityConfig,
    /// Team activity not yet written, by team and bucket.
    pending: Mutex<HashMap<(String, i64), Counter>>,
    /// How far each live sandbox's agent log has been read (a cache of the store's).
    offsets: Mutex<HashMap<String, u64>>,
    /// A kill reads the agent log while the reaper may be reading it too: one at a time, so
    /// no line is stored twice.
    ingesting: tokio::sync::Mutex<()>,
    /// Logs not yet written, by sandbox: a create answers before its log is, and anything
    /// else done with that log has it written at once and waits until it is.
    opening: Arc<Mutex<HashMap<String, PendingOpen>>>,
    /// Lifecycle events on their way to the store, written in the order they were made by
    /// one task (started with the first event).
    events: OnceLock<Option<tokio::sync::mpsc::Sender<SandboxEvent>>>,
    /// Where stored events are delivered, once the server has set it.
    webhooks: Arc<OnceLock<Webhooks>>,
}

#[derive(Clone)]
struct PendingOpen {
    hurry: Arc<Notify>,
    written: watch::Receiver<bool>,
}

fn bucket_of(at: DateTime<Utc>) -> i64 {
    at.timestamp().div_euclid(BUCKET_SECS) * BUCKET_SECS
}

impl Activity {
    pub(crate) fn new(store: Arc<Store>, config: ActivityConfig) -> Self {
        Self {
            store,
            config,
            pending: Mutex::new(HashMap::new()),
            offsets: Mutex::new(HashMap::new()),
            ingesting: tokio::sync::Mutex::new(()),
            opening: Arc::default(),
            events: OnceLock::new(),
            webhooks: Arc::default(),
        }
    }

    pub(crate) fn webhooks(&self) -> Option<&Webhooks> {
        self.webhooks.get()
    }

    /// Delivers every event stored from now on to the webhooks of its team; the first
    /// call wins.
    pub(crate) fn deliver_to(&self, webhooks: Webhooks) {
        if self.webhooks.set(webhooks).is_err() {
            tracing::warn!("sandbox events already go to webhooks");
        }
    }

    /// Records a lifecycle event. It is written in order by one task, off the path of the
    /// operation that made it; a reader may see it a few milliseconds later.
    pub(crate) fn sandbox_event(&self, event: SandboxEvent) {
        let Some(queue) = self.events.get_or_init(|| self.start_event_writer()) else {
            return;
        };
        if let Err(err) = queue.try_send(event) {
            tracing::warn!(error = %err, "sandbox event dropped: too many waiting to be written");
        }
    }

    fn start_event_writer(&self) -> Option<tokio::sync::mpsc::Sender<SandboxEvent>> {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("sandbox events are not recorded: no async runtime");
            return None;
        };
        let (queue, mut waiting) = tokio::sync::mpsc::channel(EVENTS_WAITING_MAX);
        let store = Arc::clone(&self.store);
        let webhooks = Arc::clone(&self.webhooks);
        runtime.spawn(async move {
            let mut batch = Vec::with_capacity(EVENTS_PER_WRITE);
            while waiting.recv_many(&mut batch, EVENTS_PER_WRITE).await > 0 {
                match store.sandbox_events.add_sandbox_events(&batch).await {
                    // Delivered once stored: a receiver never hears of an event the API
                    // cannot show.
                    Ok(()) => {
                        if let Some(webhooks) = webhooks.get() {
                            webhooks.dispatch(&batch).await;
                        }
                    }
                    Err(err) => {
                        tracing::warn!(events = batch.len(), error = %err, "cannot store sandbox events");
                    }
                }
                batch.clear();
            }
        });
        Some(queue)
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<(String, i64), Counter>> {
        lock(&self.pending)
    }

    fn offsets(&self) -> std::sync::MutexGuard<'_, HashMap<String, u64>> {
        lock(&self.offsets)
    }

    /// Starts a sandbox's log with its first events. Failing to log never fails the sandbox.
    pub(crate) async fn open(
        &self,
        sandbox_id: &str,
        team_id: &str,
        at: DateTime<Utc>,
        entries: &[SandboxLogEntry],
    ) {
        if let Err(err) = self
            .store
            .sandbox_logs
            .open_sandbox_log(sandbox_id, team_id, at, entries)
            .await
        {
            tracing::warn!(sandbox_id, error = %err, "cannot open sandbox log");
        }
    }

    /// Starts a sandbox's log as `open` does, but in the background and `after` from now:
    /// the log's statements are a third of a create's database time, nothing needs them
    /// before the create answers, and written at once they would take a core from the
    /// sandbox's first command. Any other call here for this log has it written at once
    /// and waits for it. A crash in between loses these first lines, not the sandbox.
    pub(crate) fn open_soon(
        &self,
        sandbox_id: &str,
        team_id: &str,
        at: DateTime<Utc>,
        entries: Vec<SandboxLogEntry>,
        after: Duration,
    ) {
        let (written, wait) = watch::channel(false);
        let hurry = Arc::new(Notify::new());
        lock(&self.opening).insert(
            sandbox_id.to_owned(),
            PendingOpen {
                hurry: hurry.clone(),
                written: wait,
            },
        );
        let store = self.store.clone();
        let opening = self.opening.clone();
        let (sandbox_id, team_id) = (sandbox_id.to_owned(), team_id.to_owned());
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(after) => {}
                _ = hurry.notified() => {}
            }
            if let Err(err) = store
                .sandbox_logs
                .open_sandbox_log(&sandbox_id, &team_id, at, &entries)
                .await
            {
                tracing::warn!(%sandbox_id, error = %err, "cannot open sandbox log");
            }
            lock(&opening).remove(&sandbox_id);
            written.send_replace(true);
        });
    }

    /// Returns once a log `open_soon` started is written (at once for any other).
    async fn opened(&self, sandbox_id: &str) {
        let pending = lock(&self.opening).get(sandbox_id).cloned();
        if let Some(PendingOpen { hurry, mut written }) = pending {
            // A stored permit: the writer may not be waiting yet.
            hurry.notify_one();
            // An error means the writer is gone (the runtime is shutting down): nothing to
            // wait for any more.
            let _ = written.wait_for(|written| *written).await;
        }
    }

    /// Appends one lifecycle event to a sandbox's log.
    pub(crate) async fn event(
        &self,
        sandbox_id: &str,
        level: LogLevel,
        message: &str,
        fields: &[(&str, String)],
    ) {
        self.opened(sandbox_id).await;
        let entry = SandboxLogEntry::event(Utc::now(), level, message, fields);
        if let Err(err) = self
            .store
            .sandbox_logs
            .append_sandbox_logs(
                sandbox_id,
                std::slice::from_ref(&entry),
                None,
                self.config.log_lines_per_sandbox,
            )
            .await
        {
            tracing::warn!(sandbox_id, error = %err, "cannot write sandbox log");
        }
    }

    /// Ends a sandbox's log with a last event; the log is kept for the retention period.
    pub(crate) async fn close(&self, sandbox_id: &str, level: LogLevel, message: &str) {
        self.event(sandbox_id, level, message, &[]).await;
        self.offsets().remove(sandbox_id);
        if let Err(err) = self
            .store
            .sandbox_logs
            .end_sandbox_log(sandbox_id, Utc::now())
            .await
        {
            tracing::warn!(sandbox_id, error = %err, "cannot close sandbox log");
        }
    }

    /// Counts a start of one of `team_id`'s sandboxes, which now has `running` at once.
    pub(crate) fn started(&self, team_id: &str, running: u32) {
        let mut pending = self.pending();
        let counter = pending
            .entry((team_id.to_owned(), bucket_of(Utc::now())))
            .or_default();
        counter.starts += 1;
        counter.concurrent = counter.concurrent.max(running);
    }

    /// Writes the team activity counted so far, with `running` (sandboxes running now, by
    /// team) as the current bucket's concurrency.
    pub(crate) async fn flush_team_metrics(&self, running: HashMap<String, u32>) {
        let bucket = bucket_of(Utc::now());
        let buckets: Vec<TeamMetricBucket> = {
            let mut pending = self.pending();
            for (team_id, count) in running {
                let counter = pending.entry((team_id, bucket)).or_default();
                counter.concurrent = counter.concurrent.max(count);
            }
            pending
                .drain()
                .map(|((team_id, bucket), c)| TeamMetricBucket {
                    team_id,
                    bucket,
                    concurrent: c.concurrent,
                    starts: c.starts,
                })
                .collect()
        };
        if buckets.is_empty() {
            return;
        }
        if let Err(err) = self.store.team_metrics.add_team_metrics(&buckets).await {
            tracing::warn!(error = %err, "cannot write team metrics");
        }
    }

    /// Reads what the sandbox's agent wrote since the last call, in whole lines, and stores
    /// it with the new offset in one transaction.
    pub(crate) async fn ingest_agent_log(&self, runtime: &dyn Runtime, sandbox_id: &str) {
        self.opened(sandbox_id).await;
        let _one_at_a_time = self.ingesting.lock().await;
        let Some(offset) = self.agent_log_offset(sandbox_id).await else {
            return;
        };
        let chunk = runtime.agent_log(sandbox_id, offset, AGENT_LOG_READ_MAX);
        self.store_agent_log(sandbox_id, offset, chunk).await;
    }

    /// Where each of `sandbox_ids`' agent logs is to be read from next, for a round that
    /// reads them all at once; a log whose offset cannot be read is left out.
    pub(crate) async fn agent_log_reads(&self, sandbox_ids: Vec<String>) -> Vec<AgentLogRead> {
        let mut reads = Vec::with_capacity(sandbox_ids.len());
        for sandbox_id in sandbox_ids {
            self.opened(&sandbox_id).await;
            if let Some(offset) = self.agent_log_offset(&sandbox_id).await {
                reads.push(AgentLogRead { sandbox_id, offset });
            }
        }
        reads
    }

    /// Stores what a round read from each log at the offset `reads` gave, unless another
    /// reader (a kill, a pause) moved that log's offset on meanwhile: the lines are then
    /// stored already, or will be at the next round.
    pub(crate) async fn ingest_agent_logs_read(
        &self,
        read: Vec<(AgentLogRead, Option<AgentLogChunk>)>,
    ) {
        for (AgentLogRead { sandbox_id, offset }, chunk) in read {
            let _one_at_a_time = self.ingesting.lock().await;
            if self.offsets().get(&sandbox_id).copied() == Some(offset) {
                self.store_agent_log(&sandbox_id, offset, chunk).await;
            }
        }
    }

    /// How far the sandbox's agent log was read, from the cache or else the store (and
    /// cached then); `None` if the store cannot say.
    async fn agent_log_offset(&self, sandbox_id: &str) -> Option<u64> {
        if let Some(offset) = self.offsets().get(sandbox_id).copied() {
            return Some(offset);
        }
        match self.store.sandbox_logs.sandbox_log_offset(sandbox_id).await {
            Ok(offset) => {
                self.offsets().insert(sandbox_id.to_owned(), offset);
                Some(offset)
            }
            Err(err) => {
                tracing::warn!(sandbox_id, error = %err, "cannot read agent log offset");
                None
            }
        }
    }

    /// Stores the whole lines of `chunk`, read from `offset`, and moves the offset past them.
    /// The caller holds `ingesting`.
    async fn store_agent_log(&self, sandbox_id: &str, offset: u64, chunk: Option<AgentLogChunk>) {
        let Some(chunk) = chunk else {
            return;
        };
        let bytes = chunk.bytes;
        let skipped = chunk.start.saturating_sub(offset);
        // A partial last line is left for the next round unless it alone fills a read.
        let consumed = match bytes.iter().rposition(|b| *b == b'\n') {
            Some(newline) => newline + 1,
            None if bytes.len() >= AGENT_LOG_READ_MAX => bytes.len(),
            None => 0,
        };
        if consumed == 0 && skipped == 0 {
            return;
        }
        let now = Utc::now();
        let mut entries: Vec<SandboxLogEntry> = Vec::new();
        if skipped > 0 {
            entries.push(SandboxLogEntry::event(
                now,
                LogLevel::Warn,
                "agent log lines were rotated away on the node before they were read",
                &[("skippedBytes", skipped.to_string())],
            ));
        }
        entries.extend(
            String::from_utf8_lossy(&bytes[..consumed])
                .lines()
                .filter_map(|line| parse_agent_line(line, now)),
        );
        let next = chunk.start.max(offset) + consumed as u64;
        match self
            .store
            .sandbox_logs
            .append_sandbox_logs(
                sandbox_id,
                &entries,
                Some(next),
                self.config.log_lines_per_sandbox,
            )
            .await
        {
            Ok(()) => {
                self.offsets().insert(sandbox_id.to_owned(), next);
            }
            Err(err) => tracing::warn!(sandbox_id, error = %err, "cannot store agent log"),
        }
    }

    /// Drops logs and metrics older than the retention period.
    pub(crate) async fn prune(&self) {
        let cutoff =
            Utc::now() - TimeDelta::from_std(self.config.retention).unwrap_or(TimeDelta::MAX / 2);
        match self.store.sandbox_events.prune_sandbox_events(cutoff).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(events = n, "pruned old sandbox events"),
            Err(err) => tracing::warn!(error = %err, "cannot prune sandbox events"),
        }
        match self.store.sandbox_logs.prune_sandbox_logs(cutoff).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(sandboxes = n, "pruned old sandbox logs"),
            Err(err) => tracing::warn!(error = %err, "cannot prune sandbox logs"),
        }
        if let Err(err) = self
            .store
            .team_metrics
            .prune_team_metrics(cutoff.timestamp())
            .await
        {
            tracing::warn!(error = %err, "cannot prune team metrics");
        }
    }

    /// A sandbox's log, live or ended; another team's is reported as not found.
    pub(crate) async fn logs(
        &self,
        team: &Team,
        sandbox_id: &str,
        query: &SandboxLogQuery,
    ) -> Result<Vec<SandboxLogEntry>, SandboxLogsError> {
        self.opened(sandbox_id).await;
        match self.store.sandbox_logs.sandbox_log_team(sandbox_id).await? {
            Some(owner) if owner == team.id => {}
            _ => return Err(SandboxLogsError::NotFound(sandbox_id.to_owned())),
        }
        Ok(self
            .store
            .sandbox_logs
            .sandbox_logs(sandbox_id, query)
            .await?)
    }

    /// The interval a team metrics read covers: both ends default (the retention period up
    /// to now) and are kept within it.
    fn interval(
        &self,
        team: &Team,
        team_id: &str,
        start: Option<i64>,
        end: Option<i64>,
    ) -> Result<(i64, i64), TeamMetricsError> {
        if team.id != team_id {
            return Err(TeamMetricsError::OtherTeam(team_id.to_owned()));
        }
        if let (Some(start), Some(end)) = (start, end)
            && start > end
        {
            return Err(TeamMetricsError::StartAfterEnd { start, end });
        }
        let now = Utc::now().timestamp();
        let oldest = now - i64::try_from(self.config.retention.as_secs()).unwrap_or(i64::MAX / 2);
        let end = end.unwrap_or(now).min(now);
        let start = start.unwrap_or(oldest).max(oldest);
        Ok((start, end))
    }

    pub(crate) async fn team_metrics(
        &self,
        team: &Team,
        team_id: &str,
        start: Option<i64>,
        end: Option<i64>,
    ) -> Result<Vec<TeamMetricPoint>, TeamMetricsError> {
        let (start, end) = self.interval(team, team_id, start, end)?;
        if start > end {
            return Ok(Vec::new());
        }
        let buckets = self.buckets(team_id, start, end).await?;
        Ok(fold(&buckets, start, end))
    }

    /// Stored buckets with the ones not yet written merged in.
    async fn buckets(
        &self,
        team_id: &str,
        start: i64,
        end: i64,
    ) -> Result<Vec<TeamMetricBucket>, TeamMetricsError> {
        // The first point covers its whole step, which may begin before `start`.
        let start = start - start.rem_euclid(step_for(start, end));
        let mut buckets = self
            .store
            .team_metrics
            .team_metrics(team_id, start, end)
            .await?;
        let unwritten: Vec<TeamMetricBucket> = self
            .pending()
            .iter()
            .filter(|((team, bucket), _)| team == team_id && (start..=end).contains(bucket))
            .map(|((team, bucket), c)| TeamMetricBucket {
                team_id: team.clone(),
                bucket: *bucket,
                concurrent: c.concurrent,
                starts: c.starts,
            })
            .collect();
        for new in unwritten {
            match buckets.iter_mut().find(|b| b.bucket == new.bucket) {
                Some(b) => {
                    b.concurrent = b.concurrent.max(new.concurrent);
                    b.starts += new.starts;
                }
                None => buckets.push(new),
            }
        }
        buckets.sort_by_key(|b| b.bucket);
        Ok(buckets)
    }

    pub(crate) async fn team_metric_max(
        &self,
        team: &Team,
        team_id: &str,
        metric: TeamMetric,
        start: Option<i64>,
        end: Option<i64>,
    ) -> Result<TeamMetricMax, TeamMetricsError> {
        let (start, end) = self.interval(team, team_id, start, end)?;
        let points = if start > end {
            Vec::new()
        } else {
            fold(&self.buckets(team_id, start, end).await?, start, end)
        };
        Ok(max_of(&points, metric, end))
    }
}
