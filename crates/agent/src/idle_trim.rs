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
//! A warm agent waiting in the pool trims too once it has waited a while; under load the pool
//! hands agents out long before that. A look every ten seconds costs one `getrusage`; a
//! trim, with the ranges known, a dozen `madvise` calls, and only follows a wake-up that
//! mapped pages back.

use std::ops::Range;
use std::time::Duration;

/// How often an agent looks at whether it has been idle.
const CHECK_EVERY: Duration = Duration::from_secs(10);

/// The CPU time an agent may have used since the last look and still count as idle. The
/// reaper's sweep and a look cost microseconds; one command costs milliseconds.
const IDLE_CPU: Duration = Duration::from_millis(5);

/// Minor faults since the last trim that an idle look lets pass without trimming again: the
/// look's own sleep and clock read map back a few pages of code each time.
const FAULTS_OF_A_LOOK: u64 = 16;

/// Starts the thread that drops the agent's code mappings whenever it has been idle for a
/// look. A plain thread, not a task: its wake-up touches a few pages of code, where one of
/// the async runtime's maps back a good part of what the trim dropped.
pub(crate) fn start() {
    let started = std::thread::Builder::new()
        .name("idle-trim".into())
        .stack_size(64 * 1024)
        .spawn(trim_while_idle);
    if let Err(e) = started {
        tracing::warn!(error = %e, "cannot start the idle trim");
    }
}

/// What the last trim dropped, and the process's minor faults right after it.
struct Trimmed {
    code: Vec<Range<usize>>,
    faults_after: u64,
}

fn trim_while_idle() {
    // Kept while the agent stays idle: loaded objects are never unmapped, so the ranges read
    // from smaps at the first idle look after activity stay right.
    let mut trimmed: Option<Trimmed> = None;
    let mut before = usage();
    loop {
        std::thread::sleep(CHECK_EVERY);
        let now = usage();
        let idle = match (&before, &now) {
            (Some(before), Some(now)) => now.cpu.saturating_sub(before.cpu) < IDLE_CPU,
            _ => false,
        };
        let mut dropped = None;
        if !idle {
            trimmed = None;
        } else if mapped_back(
            trimmed.as_ref().map(|t| t.faults_after),
            now.as_ref().map(|n| n.minor_faults),
        ) {
            // An idle agent still wakes now and then (the reaper's sweep, a runtime timer)
            // and maps back what it runs, so an idle look trims again after such a wake-up.
            let code = match trimmed.take() {
                Some(t) => Ok(t.code),
                None => std::fs::read_to_string("/proc/self/smaps").map(|s| droppable_code(&s)),
            };
            match code.and_then(|code| drop_mappings(&code).map(|()| code)) {
                Ok(code) => dropped = Some(code),
                Err(e) => tracing::debug!(error = %e, "cannot drop code mappings"),
            }
        }
        // Read after the trim, so that the trim's own cost never reads as activity.
        before = usage();
        if let (Some(code), Some(after)) = (dropped, &before) {
            trimmed = Some(Trimmed {
                code,
                faults_after: after.minor_faults,
            });
        }
    }
}

/// Whether the faults taken since the last trim (unknown counts as many) are more than a
/// look's own.
fn mapped_back(faults_after_trim: Option<u64>, faults_now: Option<u64>) -> bool {
    match (faults_after_trim, faults_now) {
        (Some(then), Some(now)) => now.saturating_sub(then) > FAULTS_OF_A_LOOK,
        _ => true,
    }
}

/// This process's CPU time and the page faults it took that needed no read from disk, all
/// threads together: one `getrusage` a look.
struct Usage {
    cpu: Duration,
    minor_faults: u64,
}

fn usage() -> Option<Usage> {
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
    Some(Usage {
        cpu: time(usage.ru_utime) + time(usage.ru_stime),
        minor_faults: u64::try_from(usage.ru_minflt).ok()?,
    })
}

/// Drops this process's page-table entries for `ranges`, which [`droppable_code`] picked
/// from its own `/proc/self/smaps`.
fn drop_mappings(ranges: &[Range<usize>]) -> std::io::Result<()> {
    for range in ranges {
        // SAFETY: `range` is one of this process's own private, read-only mappings of a
        // loaded ELF object holding no private (copied) page. Such a mapping is never
        // unmapped while the process runs, and dropping its entries loses nothing: the next
        // access maps the same page-cache page again.
        let done = unsafe {
            libc::madvise(
                range.start as *mut libc::c_void,
                range.end - range.start,
                libc::MADV_DONTNEED,
            )
        };
        if done != 0 {
            return Err(std::io::Error::last_os_error());
        }
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

    #[test]
    fn a_trim_follows_faults_beyond_those_of_a_look() {
        let now = usage().expect("getrusage").minor_faults;
        assert!(now > 0, "a running process has faulted pages in");
        assert!(!mapped_back(Some(100), Some(100)));
        assert!(!mapped_back(Some(100), Some(100 + FAULTS_OF_A_LOOK)));
        assert!(mapped_back(Some(100), Some(101 + FAULTS_OF_A_LOOK)));
        assert!(mapped_back(None, Some(now)), "the first idle look trims");
        assert!(mapped_back(Some(100), None), "an unknown count trims");
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
