//! Every byte of many first commands, compared: sandboxes taken one after another from the
//! warm pool next to a crowd of idle ones, each running one command whose whole output is
//! checked. The crowd is what makes a loss likely: the agent that must deliver the output is
//! then the one waiting longest for a CPU.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::client::{Api, Ran, Sandbox};

/// How long the crowd's sandboxes live: past any run, killed by the benchmark at its end.
const CROWD_TIMEOUT_SECS: u64 = 4 * 3600;
/// Sandboxes made at once for the crowd.
const CROWD_BATCH: usize = 16;

/// What the run found.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Commands whose output came back whole.
    pub matched: usize,
    /// Commands that ran (exit 0, with an end) but printed something else, with what.
    pub mismatched: Vec<String>,
    /// Creates or commands that failed outright.
    pub failed: Vec<String>,
    /// Time from each command's request to its first stdout.
    pub first_output: Vec<Duration>,
    /// Wall time of the churn.
    pub wall: Duration,
}

/// The text a command prints: its sequence number, its sandbox, then a fixed filler, so a
/// truncated, empty or misdelivered output is told apart from the right one.
fn payload(seq: usize, sandbox: &str) -> String {
    format!("{seq:06}:{sandbox}:{}", "0123456789abcdef".repeat(8))
}

fn judge(outcome: &mut Outcome, seq: usize, sandbox: &str, ran: anyhow::Result<Ran>) {
    let expected = payload(seq, sandbox);
    match ran {
        Ok(ran) if ran.stdout == expected.as_bytes() => {
            outcome.matched += 1;
            outcome.first_output.extend(ran.first);
        }
        Ok(ran) => outcome.mismatched.push(format!(
            "command {seq} in {sandbox}: printed {:?} ({} bytes), wanted {} bytes",
            String::from_utf8_lossy(&ran.stdout),
            ran.stdout.len(),
            expected.len()
        )),
        Err(e) => outcome
            .failed
            .push(format!("command {seq} in {sandbox}: {e:#}")),
    }
}

/// Makes `crowd` idle sandboxes, each answering its first command, then runs `commands`
/// create→first command→kill cycles, `concurrency` at a time, next to them.
pub async fn run(
    api: &Api,
    crowd: usize,
    commands: usize,
    concurrency: usize,
) -> anyhow::Result<Outcome> {
    let mut outcome = Outcome::default();
    let started = Instant::now();
    let mut made = 0;
    while made < crowd {
        let batch = (crowd - made).min(CROWD_BATCH);
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..batch {
            let api = api.clone();
            let seq = made + i;
            tasks.spawn(async move {
                let sandbox = api.create_for(CROWD_TIMEOUT_SECS).await?;
                let ran = api.print(&sandbox, &payload(seq, &sandbox.id)).await;
                anyhow::Ok((seq, sandbox, ran))
            });
        }
        while let Some(joined) = tasks.join_next().await {
            let (seq, sandbox, ran) = joined.map_err(anyhow::Error::from).and_then(|r| r)?;
            judge(&mut outcome, seq, &sandbox.id, ran);
        }
        made += batch;
    }
    eprintln!(
        "  {crowd} idle sandboxes made, each answering its first command, in {:.1?}",
        started.elapsed()
    );

    let next = Arc::new(AtomicUsize::new(crowd));
    let last = crowd + commands;
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let api = api.clone();
        let next = next.clone();
        workers.spawn(async move {
            let mut mine = Outcome::default();
            loop {
                let seq = next.fetch_add(1, Ordering::Relaxed);
                if seq >= last {
                    return mine;
                }
                let sandbox: Sandbox = match api.create().await {
                    Ok(sandbox) => sandbox,
                    Err(e) => {
                        mine.failed.push(format!("create {seq}: {e:#}"));
                        continue;
                    }
                };
                let ran = api.print(&sandbox, &payload(seq, &sandbox.id)).await;
                judge(&mut mine, seq, &sandbox.id, ran);
                if let Err(e) = api.kill(&sandbox.id).await {
                    mine.failed.push(format!("kill {}: {e:#}", sandbox.id));
                }
                if seq.is_multiple_of(500) {
                    eprintln!("  command {seq} of {last}");
                }
            }
        });
    }
    while let Some(joined) = workers.join_next().await {
        let mine = joined.context("a worker panicked")?;
        outcome.matched += mine.matched;
        outcome.mismatched.extend(mine.mismatched);
        outcome.failed.extend(mine.failed);
        outcome.first_output.extend(mine.first_output);
    }
    outcome.wall = started.elapsed();
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_whole_payload_matches() {
        let mut outcome = Outcome::default();
        let whole = |text: &str| {
            Ok(Ran {
                first: Some(Duration::from_millis(1)),
                stdout: text.as_bytes().to_vec(),
            })
        };
        judge(&mut outcome, 7, "sbx", whole(&payload(7, "sbx")));
        judge(&mut outcome, 8, "sbx", whole(""));
        judge(&mut outcome, 9, "sbx", whole(&payload(9, "sbx")[..20]));
        judge(&mut outcome, 10, "sbx", whole(&payload(10, "other")));
        judge(
            &mut outcome,
            11,
            "sbx",
            Err(anyhow::anyhow!("no end event")),
        );
        assert_eq!(outcome.matched, 1);
        assert_eq!(outcome.mismatched.len(), 3);
        assert_eq!(outcome.failed.len(), 1);
        assert_eq!(outcome.first_output.len(), 1);
    }
}
