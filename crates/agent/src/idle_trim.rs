//! An idle agent gives up its page-table entries for code.
//!
//! Every agent on a host maps the same pages of its own binary and of the C library: about
//! 5 MiB of code and read-only data stays mapped in each idle agent. The kernel's page aging
//! (reclaim under memory pressure, and DAMON's access sampling where the host runs it) checks
//! a shared page once for every process that maps it, holding the file's mapping lock, so a
//! thousand idle agents make each check of those pages a thousand times dearer and make every
//! exec and exit of the agent binary wait behind it. An agent that has been idle drops its
//! entries for those pages; the pages stay in the page cache, and the agent's next request maps
//! back the ones it needs with minor faults.
//!
//! The looks run on the reaper's thread, which sleeps in `poll` until a child ends or a
//! request arrives ([`note_activity`]). After a wake-up it looks again every ten seconds
//! until a look finds the agent idle; it then trims once and sleeps with no timeout, so an
//! idle agent runs nothing at all and maps back nothing between its trims. A warm agent
//! waiting in the pool trims too once it has waited a look; under load the pool hands agents
//! out long before that.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long after a wake-up an agent looks at whether it has been idle, and between looks.
const LOOK_EVERY: Duration = Duration::from_secs(10);

/// The CPU time an agent may have used since the last look and still count as idle. A
/// look and a reaped orphan cost microseconds; one command costs milliseconds.
const IDLE_CPU: Duration = Duration::from_millis(5);

/// Set by a booted agent, whose code is shared with every other sandbox on its host.
static ENABLED: AtomicBool = AtomicBool::new(false);
/// Requests served so far.
static REQUESTS: AtomicU64 = AtomicU64::new(0);
/// Whether the reaper's thread sleeps with no timeout, so a request must wake it.
static ASLEEP: AtomicBool = AtomicBool::new(false);

/// Makes this agent drop its code mappings whenever it has been idle for a look.
pub(crate) fn enable() {
    ENABLED.store(true, Ordering::SeqCst);
    crate::reaper::wake();
}

/// Counts a request; one that finds the agent trimmed and asleep wakes it, so that the
/// code the request maps back is dropped again once the agent is idle.
pub(crate) fn note_activity() {
    REQUESTS.fetch_add(1, Ordering::SeqCst);
    if ASLEEP.load(Ordering::Relaxed) && ASLEEP.swap(false, Ordering::SeqCst) {
        crate::reaper::wake();
    }
}

/// Where the idle trim stands, kept by the reaper's thread.
#[derive(Debug)]
pub(crate) struct IdleTrim {
    phase: Phase,
    /// The ranges of the last trim, kept until the next one: freeing them right after the
    /// trim would run the allocator and map its code back.
    trimmed: Vec<Range<usize>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Something happened lately: the next look is due at `next_look`, measured against
    /// the CPU time and requests at the last one.
    Watching {
        next_look: Instant,
        cpu: Option<Duration>,
        requests: u64,
    },
    /// Trimmed after an idle look; only a wake-up brings it back to watching.
    Asleep,
}

impl Phase {
    /// Watching from `now`, against the CPU time and requests of `now`.
    fn watching(now: Instant, cpu: Option<Duration>, requests: u64) -> Self {
        Phase::Watching {
            next_look: now + LOOK_EVERY,
            cpu,
            requests,
        }
    }
}

/// What a wake-up asks of the reaper's thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Nothing,
    /// The agent was idle since the last look: drop its code and sleep.
    Trim,
}

impl IdleTrim {
    pub(crate) fn new(now: Instant) -> Self {
        Self {
            phase: Phase::watching(now, cpu_time(), REQUESTS.load(Ordering::SeqCst)),
            trimmed: Vec::new(),
        }
    }

    /// When the reaper's thread must wake for the next look; `None` when it need not look
    /// again until woken (asleep, or not a booted agent).
    pub(crate) fn next_look(&self) -> Option<Instant> {
        if !ENABLED.load(Ordering::SeqCst) {
            return None;
        }
        self.look_due()
    }

    fn look_due(&self) -> Option<Instant> {
        match self.phase {
            Phase::Watching { next_look, .. } => Some(next_look),
            Phase::Asleep => None,
        }
    }

    /// Runs after every wake-up of the reaper's thread: a look when one is due, and the
    /// trim when it finds the agent idle.
    pub(crate) fn after_wake(&mut self, now: Instant) {
        if !ENABLED.load(Ordering::SeqCst) {
            return;
        }
        let mut requests = 0;
        let sample = || {
            requests = REQUESTS.load(Ordering::SeqCst);
            (cpu_time(), requests)
        };
        if self.step(now, sample) == Step::Trim {
            match droppable_now() {
                Ok(code) => {
                    self.trimmed = code;
                    if let Err(e) = drop_mappings(&self.trimmed) {
                        tracing::debug!(error = %e, "cannot drop code mappings");
                    }
                }
                Err(e) => tracing::debug!(error = %e, "cannot read this agent's mappings"),
            }
            ASLEEP.store(true, Ordering::SeqCst);
            // A request that came in during the look did not know to wake the thread.
            if REQUESTS.load(Ordering::SeqCst) != requests && ASLEEP.swap(false, Ordering::SeqCst) {
                self.phase = Phase::watching(Instant::now(), cpu_time(), requests);
            }
        }
    }

    /// The decision, given `sample`, which reads the process's CPU time and requests served
    /// now: called only when they count, so a wake-up before the look (a reaped child) reads
    /// nothing.
    fn step(&mut self, now: Instant, sample: impl FnOnce() -> (Option<Duration>, u64)) -> Step {
        match self.phase {
            // Anything that wakes a sleeping agent is activity.
            Phase::Asleep => {
                let (cpu_now, requests_now) = sample();
                self.phase = Phase::watching(now, cpu_now, requests_now);
                Step::Nothing
            }
            Phase::Watching { next_look, .. } if now < next_look => Step::Nothing,
            Phase::Watching { cpu, requests, .. } => {
                let (cpu_now, requests_now) = sample();
                let idle = match (cpu, cpu_now) {
                    (Some(then), Some(now)) => now.saturating_sub(then) < IDLE_CPU,
                    _ => false,
                } && requests == requests_now;
                if idle {
                    self.phase = Phase::Asleep;
                    Step::Trim
                } else {
                    self.phase = Phase::watching(now, cpu_now, requests_now);
                    Step::Nothing
                }
            }
        }
    }
}

/// The droppable mappings of code, read afresh from smaps: a trim is rare (once per spell
/// of activity), and a library loaded or unloaded since the last one is then seen as it is.
fn droppable_now() -> std::io::Result<Vec<Range<usize>>> {
    Ok(droppable_code(&std::fs::read_to_string(
        "/proc/self/smaps",
    )?))
}

/// This process's CPU time, all threads together.
fn cpu_time() -> Option<Duration> {
    // SAFETY: an all-zero rusage is a valid value of the plain C struct getrusage fills.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage only writes the struct we pass a valid pointer to.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return None;
    }
    let time = |t: libc::timeval| {
        Duration::from_secs(u64::try_from(t.tv_sec).unwrap_or(0))
            + Duration::from_micros(u64::try_from(t.tv_usec).unwrap_or(0))
    };
    Some(time(usage.ru_utime) + time(usage.ru_stime))
}

/// Drops this process's page-table entries for `ranges`, which [`droppable_code`] picked
/// from its own `/proc/self/smaps`.
fn drop_mappings(ranges: &[Range<usize>]) -> std::io::Result<()> {
    for range in ranges {
        // SAFETY: `range` is one of this process's own private, read-only mappings of a
        // loaded ELF object holding no private (copied) page, read from smaps just before.
        // Such a mapping is never unmapped while the process runs, and dropping its entries
        // loses nothing: the next access maps the same page-cache page again. rustix makes
        // the call itself, so the C library's code it drops is not mapped back by the loop.
        unsafe {
            rustix::mm::madvise(
                range.start as *mut std::ffi::c_void,
                range.end - range.start,
                rustix::mm::Advice::LinuxDontNeed,
            )
        }?;
    }
    Ok(())
}

/// One mapping as `/proc/<pid>/smaps` describes it.
#[derive(Debug, Default)]
struct Mapping<'a> {
    range: Range<usize>,
    perms: &'a str,
    path: &'a str,
    resident_kb: u64,
    anonymous_kb: u64,
    locked: bool,
}

impl Mapping<'_> {
    fn is_code(&self) -> bool {
        self.perms.as_bytes().get(2) == Some(&b'x')
    }

    /// Private, not writable, backed by the file alone (no page of it was ever copied on
    /// write: relocated data shows as anonymous), mapped in part, and not locked.
    fn droppable(&self) -> bool {
        let perms = self.perms.as_bytes();
        perms.get(1) == Some(&b'-')
            && perms.get(3) == Some(&b'p')
            && self.resident_kb > 0
            && self.anonymous_kb == 0
            && !self.locked
    }
}

fn parse_smaps(smaps: &str) -> Vec<Mapping<'_>> {
    let mut mappings: Vec<Mapping<'_>> = Vec::new();
    for line in smaps.lines() {
        if let Some(mapping) = parse_header(line) {
            mappings.push(mapping);
            continue;
        }
        let Some(current) = mappings.last_mut() else {
            continue;
        };
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let kb = || {
            value
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        };
        match key {
            "Rss" => current.resident_kb = kb().unwrap_or(0),
            // Unreadable counts as copied, so that such a mapping is left alone.
            "Anonymous" => current.anonymous_kb = kb().unwrap_or(u64::MAX),
            "VmFlags" => current.locked = value.split_whitespace().any(|flag| flag == "lo"),
            _ => {}
        }
    }
    mappings
}

/// `start-end perms offset dev inode [path]`; `None` for any other line.
fn parse_header(line: &str) -> Option<Mapping<'_>> {
    let mut fields = line.split_whitespace();
    let (start, end) = fields.next()?.split_once('-')?;
    let range = usize::from_str_radix(start, 16).ok()?..usize::from_str_radix(end, 16).ok()?;
    let perms = fields.next()?;
    if perms.len() != 4 {
        return None;
    }
    let _offset = fields.next()?;
    let _device = fields.next()?;
    let _inode = fields.next()?;
    let path = fields.next().unwrap_or("");
    Some(Mapping {
        range,
        perms,
        path,
        // A mapping whose counts are missing is never dropped.
        anonymous_kb: u64::MAX,
        ..Mapping::default()
    })
}

/// The ranges whose entries may go: the droppable mappings of files that are mapped
/// executable, which are the loaded ELF objects (the agent and its libraries). A data file
/// some code maps, and may unmap at any time, is never one of them.
fn droppable_code(smaps: &str) -> Vec<Range<usize>> {
    let mappings = parse_smaps(smaps);
    let code_files: Vec<&str> = mappings
        .iter()
        .filter(|m| m.path.starts_with('/') && m.is_code())
        .map(|m| m.path)
        .collect();
    mappings
        .into_iter()
        .filter(|m| code_files.contains(&m.path) && m.droppable())
        .map(|m| m.range)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(header: &str, rss: u64, anonymous: u64, flags: &str) -> String {
        format!(
            "{header}\nSize: 100 kB\nRss: {rss} kB\nPss: 1 kB\nAnonymous: {anonymous} kB\nVmFlags: {flags}\n"
        )
    }

    #[test]
    fn only_clean_read_only_mappings_of_loaded_objects_are_dropped() {
        let smaps = [
            entry(
                "1000-2000 r--p 00000000 00:20 7 /agents/abc",
                448,
                0,
                "rd mr mw me",
            ),
            entry(
                "2000-3000 r-xp 00001000 00:20 7 /agents/abc",
                3092,
                0,
                "rd ex mr mw me",
            ),
            // Relocated read-only data: its pages were copied, dropping them would undo
            // the relocations.
            entry(
                "3000-4000 r--p 00002000 00:20 7 /agents/abc",
                376,
                376,
                "rd mr mw me",
            ),
            entry(
                "4000-5000 rw-p 00003000 00:20 7 /agents/abc",
                16,
                16,
                "rd wr mr mw me",
            ),
            entry("5000-6000 rw-p 00000000 00:00 0 [heap]", 128, 128, "rd wr"),
            // A data file mapped read-only: not a loaded object, may be unmapped any time.
            entry(
                "6000-7000 r--p 00000000 08:01 9 /tmp/data.bin",
                8,
                0,
                "rd mr mw me",
            ),
            // Nothing mapped: nothing to drop.
            entry(
                "7000-8000 r-xp 00000000 08:01 5 /usr/lib/libgcc_s.so.1",
                0,
                0,
                "rd ex",
            ),
            // Locked pages refuse MADV_DONTNEED.
            entry(
                "8000-9000 r-xp 00000000 08:01 6 /usr/lib/libc.so.6",
                768,
                0,
                "rd ex lo",
            ),
            entry(
                "9000-a000 r--p 00000000 08:01 6 /usr/lib/libc.so.6",
                152,
                0,
                "rd mr",
            ),
            // A shared mapping is another writer's, never ours to drop.
            entry(
                "a000-b000 r-xs 00000000 08:01 6 /usr/lib/libc.so.6",
                4,
                0,
                "rd ex sh",
            ),
            entry("b000-c000 r-xp 00000000 00:00 0 [vdso]", 4, 0, "rd ex"),
        ]
        .concat();
        assert_eq!(
            droppable_code(&smaps),
            vec![0x1000..0x2000, 0x2000..0x3000, 0x9000..0xa000]
        );
    }

    #[test]
    fn a_mapping_without_its_counts_is_kept() {
        let smaps = "1000-2000 r-xp 00000000 08:01 6 /usr/lib/libc.so.6\nRss: 8 kB\n";
        assert!(droppable_code(smaps).is_empty());
    }

    const MS: fn(u64) -> Duration = Duration::from_millis;

    fn watching_from(start: Instant) -> IdleTrim {
        IdleTrim {
            phase: Phase::watching(start, Some(MS(100)), 7),
            trimmed: Vec::new(),
        }
    }

    #[test]
    fn a_wake_up_before_the_look_changes_nothing() {
        let start = Instant::now();
        let mut trim = watching_from(start);
        let before = trim.phase;
        assert_eq!(
            trim.step(start + MS(9_999), || unreachable!(
                "no sample before the look"
            )),
            Step::Nothing
        );
        assert_eq!(trim.phase, before, "the look stays where it was due");
    }

    #[test]
    fn an_idle_look_trims_and_sleeps_until_woken() {
        let start = Instant::now();
        let mut trim = watching_from(start);
        assert_eq!(
            trim.step(start + LOOK_EVERY, || (Some(MS(101)), 7)),
            Step::Trim,
            "a millisecond of CPU and no request in a look is idle"
        );
        assert_eq!(trim.phase, Phase::Asleep);
        assert_eq!(trim.look_due(), None, "no look due asleep");
    }

    #[test]
    fn a_busy_look_watches_another_look_from_there() {
        let start = Instant::now();
        for (cpu, requests) in [(Some(MS(100) + IDLE_CPU), 7), (Some(MS(100)), 8), (None, 7)] {
            let mut trim = watching_from(start);
            let look = start + LOOK_EVERY + MS(3);
            assert_eq!(trim.step(look, || (cpu, requests)), Step::Nothing);
            assert_eq!(trim.phase, Phase::watching(look, cpu, requests));
        }
    }

    #[test]
    fn any_wake_up_of_a_sleeping_agent_starts_a_look() {
        let start = Instant::now();
        let mut trim = IdleTrim {
            phase: Phase::Asleep,
            trimmed: Vec::new(),
        };
        assert_eq!(trim.step(start, || (Some(MS(5)), 9)), Step::Nothing);
        assert_eq!(trim.phase, Phase::watching(start, Some(MS(5)), 9));
        assert_eq!(trim.look_due(), Some(start + LOOK_EVERY));
    }

    #[test]
    fn the_process_cpu_time_is_known() {
        assert!(cpu_time().is_some_and(|t| t > Duration::ZERO));
    }

    #[test]
    fn this_process_can_drop_its_code_and_keep_running() {
        let resident_code = || {
            let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
            let code = droppable_code(&smaps);
            let kb: u64 = parse_smaps(&smaps)
                .iter()
                .filter(|m| code.contains(&m.range))
                .map(|m| m.resident_kb)
                .sum();
            (code, kb)
        };
        let (code, before_kb) = resident_code();
        assert!(!code.is_empty(), "a running test maps some of its own code");
        drop_mappings(&code).expect("trim");
        // Reading smaps again runs code, which maps back only the pages it touches.
        let (_, after_kb) = resident_code();
        assert!(
            after_kb < before_kb,
            "{after_kb} kB of code still mapped after the trim, {before_kb} kB before"
        );
    }
}
