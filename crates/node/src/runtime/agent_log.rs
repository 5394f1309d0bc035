//! Sandbox agent logs on the host (`<data>/logs/<id>.log`) and their rotation.
//!
//! The agent appends to its log through a descriptor its sandbox holds across pauses,
//! checkpoints and restores, and a checkpoint records the file with its size: the file is
//! never replaced. Once it passes a size, its bytes are copied to `<id>.log.1` (replacing the
//! copy before) and the file is truncated in place, so at most twice that size stays on disk.
//! Offsets count from the first byte the log ever held: `<id>.log.start` says where the
//! current file begins, and `<id>.log.1` holds the bytes just before that.

use std::ffi::OsString;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use sandbar_core::AgentLogChunk;

/// Rounds of copying what was appended while copying, before the file is truncated.
const COPY_ROUNDS: usize = 4;

/// One sandbox's agent log and the files its rotation keeps beside it.
#[derive(Debug, Clone)]
pub struct AgentLog {
    current: PathBuf,
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = OsString::from(path.as_os_str());
    name.push(suffix);
    PathBuf::from(name)
}

/// Up to `max` bytes of `file` from `at` on.
fn read_at(file: &mut File, at: u64, max: usize) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    if max == 0 || file.metadata()?.len() <= at {
        return Ok(bytes);
    }
    file.seek(SeekFrom::Start(at))?;
    file.take(max as u64).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Replaces `path` with `bytes` at once, so a crash leaves the old or the new content.
fn replace(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let temporary = with_suffix(path, ".tmp");
    let mut file = File::create(&temporary)?;
    file.write_all(bytes)?;
    std::fs::rename(&temporary, path)
}

impl AgentLog {
    pub fn new(current: PathBuf) -> Self {
        Self { current }
    }

    pub fn path(&self) -> &Path {
        &self.current
    }

    fn previous(&self) -> PathBuf {
        with_suffix(&self.current, ".1")
    }

    fn start_file(&self) -> PathBuf {
        with_suffix(&self.current, ".start")
    }

    /// The offset of the current file's first byte; 0 for a log never rotated.
    fn start(&self) -> u64 {
        std::fs::read_to_string(self.start_file())
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Up to `max` bytes from `offset` on: from the previous file where the offset is in it,
    /// going on into the current one; from the oldest byte kept when the offset was rotated
    /// away. `None` when there is no log.
    pub fn read(&self, offset: u64, max: usize) -> Option<AgentLogChunk> {
        let mut current = File::open(&self.current).ok()?;
        let start = self.start();
        let (from, mut bytes) = if offset >= start {
            (offset, Vec::new())
        } else {
            match File::open(self.previous()) {
                Ok(mut previous) => {
                    let kept = previous.metadata().ok()?.len();
                    let previous_start = start.saturating_sub(kept);
                    let from = offset.max(previous_start);
                    (
                        from,
                        read_at(&mut previous, from - previous_start, max).ok()?,
                    )
                }
                Err(_) => (start, Vec::new()),
            }
        };
        let reached = from + bytes.len() as u64;
        if reached >= start && bytes.len() < max {
            let more = read_at(&mut current, reached - start, max - bytes.len()).ok()?;
            bytes.extend_from_slice(&more);
        }
        Some(AgentLogChunk { start: from, bytes })
    }

    /// When the log is longer than `limit` and `may_rotate` agrees, moves its bytes to the
    /// previous file and empties it in place; whether it did. A line the agent appends
    /// between the last copy and the truncation is lost.
    pub fn rotate_if_over(
        &self,
        limit: u64,
        may_rotate: impl FnOnce() -> bool,
    ) -> std::io::Result<bool> {
        let mut file = match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.current)
        {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e),
        };
        if file.metadata()?.len() <= limit || !may_rotate() {
            return Ok(false);
        }
        let mut copy = Vec::new();
        for _ in 0..COPY_ROUNDS {
            let more = read_at(&mut file, copy.len() as u64, usize::MAX)?;
            if more.is_empty() {
                break;
            }
            copy.extend_from_slice(&more);
        }
        let start = self.start();
        replace(&self.previous(), &copy)?;
        replace(
            &self.start_file(),
            (start + copy.len() as u64).to_string().as_bytes(),
        )?;
        file.set_len(0)?;
        Ok(true)
    }

    /// Removes the log and what its rotation kept.
    pub fn remove(&self) {
        for path in [self.current.clone(), self.previous(), self.start_file()] {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::path::Path;

    use super::AgentLog;

    fn append(path: &Path, text: &str) {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .expect("open");
        file.write_all(text.as_bytes()).expect("write");
    }

    fn read_all(log: &AgentLog, mut offset: u64) -> (u64, String) {
        let first = log.read(offset, 1 << 20).expect("log");
        let skipped_to = first.start;
        let mut text = String::from_utf8(first.bytes.clone()).expect("utf-8");
        offset = first.start + first.bytes.len() as u64;
        loop {
            let next = log.read(offset, 4).expect("log");
            if next.bytes.is_empty() {
                break;
            }
            assert_eq!(next.start, offset);
            offset += next.bytes.len() as u64;
            text.push_str(&String::from_utf8(next.bytes).expect("utf-8"));
        }
        (skipped_to, text)
    }

    #[test]
    fn a_rotated_log_keeps_its_inode_and_reads_on_across_the_two_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = AgentLog::new(dir.path().join("s.log"));
        append(log.path(), "one\ntwo\n");
        let writer = std::fs::OpenOptions::new()
            .append(true)
            .open(log.path())
            .expect("open");
        let inode =
            |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).expect("stat"));
        let before = inode(log.path());

        assert!(
            !log.rotate_if_over(100, || true).expect("rotate"),
            "rotated under the limit"
        );
        assert!(log.rotate_if_over(4, || true).expect("rotate"));
        assert_eq!(inode(log.path()), before);
        assert_eq!(std::fs::metadata(log.path()).expect("stat").len(), 0);
        // The agent's descriptor appends at the new end.
        (&writer).write_all(b"three\n").expect("write");
        assert_eq!(
            std::fs::read_to_string(log.path()).expect("read"),
            "three\n"
        );

        // Read from the start: the previous file, then on into the current one.
        assert_eq!(read_all(&log, 0), (0, "one\ntwo\nthree\n".into()));
        // From within the previous file, and from within the current one.
        assert_eq!(read_all(&log, 4).1, "two\nthree\n");
        assert_eq!(read_all(&log, 8).1, "three\n");
        let chunk = log.read(10, 100).expect("log");
        assert_eq!((chunk.start, chunk.bytes.as_slice()), (10, &b"ree\n"[..]));
    }

    #[test]
    fn offsets_rotated_away_twice_skip_to_the_oldest_byte_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = AgentLog::new(dir.path().join("s.log"));
        append(log.path(), "aaaa\n");
        assert!(log.rotate_if_over(1, || true).expect("rotate"));
        append(log.path(), "bbbb\n");
        assert!(log.rotate_if_over(1, || true).expect("rotate"));
        append(log.path(), "cc\n");
        // 0..5 is gone, 5..10 is the previous file, 10.. the current one.
        assert_eq!(read_all(&log, 2), (5, "bbbb\ncc\n".into()));
        let on_disk: u64 = ["s.log", "s.log.1"]
            .iter()
            .map(|n| std::fs::metadata(dir.path().join(n)).expect("stat").len())
            .sum();
        assert_eq!(on_disk, 8);
    }

    #[test]
    fn a_log_is_left_alone_when_rotation_is_not_allowed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = AgentLog::new(dir.path().join("s.log"));
        append(log.path(), "held by a checkpoint\n");
        assert!(!log.rotate_if_over(1, || false).expect("rotate"));
        assert_eq!(read_all(&log, 0).1, "held by a checkpoint\n");
        log.remove();
        assert!(log.read(0, 10).is_none());
        assert!(!dir.path().join("s.log.1").exists());
    }
}
