//! A build step's output turned into log lines, in bounded memory whatever the step prints:
//! lines longer than [`MAX_LINE_BYTES`] are split, and a step keeps at most a number of lines
//! and bytes; the rest is only counted, for a note at the end.

/// Longest log line; a longer output line becomes several.
pub const MAX_LINE_BYTES: usize = 8 << 10;
/// Bytes of output lines one step keeps.
pub const MAX_STEP_BYTES: usize = 1 << 20;

/// One step's output on its way to the build log.
#[derive(Debug)]
pub struct StepOutput {
    max_lines: usize,
    max_bytes: usize,
    line_bytes: usize,
    /// The line not yet ended; never longer than `line_bytes`.
    pending: Vec<u8>,
    lines: usize,
    bytes: usize,
    dropped_lines: u64,
    dropped_bytes: u64,
}

impl StepOutput {
    /// Keeps at most `max_lines` lines (and [`MAX_STEP_BYTES`]) of a step's output.
    pub fn new(max_lines: usize) -> Self {
        Self::with_limits(max_lines, MAX_STEP_BYTES, MAX_LINE_BYTES)
    }

    fn with_limits(max_lines: usize, max_bytes: usize, line_bytes: usize) -> Self {
        let line_bytes = line_bytes.max(4);
        Self {
            max_lines,
            max_bytes,
            line_bytes,
            pending: Vec::with_capacity(line_bytes),
            lines: 0,
            bytes: 0,
            dropped_lines: 0,
            dropped_bytes: 0,
        }
    }

    /// Takes the next piece of output, handing every line it completes to `emit`.
    pub fn push(&mut self, mut data: &[u8], mut emit: impl FnMut(String)) {
        while !data.is_empty() {
            let room = self.line_bytes - self.pending.len();
            // One byte beyond the room tells a line of exactly the longest length from a
            // longer one.
            let window = &data[..data.len().min(room + 1)];
            if let Some(end) = window.iter().position(|b| *b == b'\n') {
                self.pending.extend_from_slice(&window[..end]);
                data = &data[end + 1..];
                let line = std::mem::take(&mut self.pending);
                self.line(&line, &mut emit);
                self.pending = line;
                self.pending.clear();
            } else if window.len() > room {
                self.pending.extend_from_slice(&data[..room]);
                data = &data[room..];
                self.split(&mut emit);
            } else {
                self.pending.extend_from_slice(window);
                data = &[];
            }
        }
    }

    /// Emits what is left of the last line; returns the note on what was not kept, if any.
    pub fn finish(mut self, mut emit: impl FnMut(String)) -> Option<String> {
        if !self.pending.is_empty() {
            let line = std::mem::take(&mut self.pending);
            self.line(&line, &mut emit);
        }
        (self.dropped_lines > 0).then(|| {
            format!(
                "{} more output lines ({} bytes) not kept: a step keeps at most {} lines and {} bytes of output, lines longer than {} bytes split",
                self.dropped_lines,
                self.dropped_bytes,
                self.max_lines,
                self.max_bytes,
                self.line_bytes
            )
        })
    }

    /// Emits the full pending line up to its last whole character, keeping the rest (the
    /// start of a character cut in two) for the next line.
    fn split(&mut self, emit: &mut impl FnMut(String)) {
        let cut = char_boundary(&self.pending);
        let rest = self.pending.split_off(cut);
        let line = std::mem::replace(&mut self.pending, rest);
        self.line(&line, emit);
        // `split_off` gave the rest a small buffer of its own; keep the line's, which is
        // already as large as a line gets.
        let mut buffer = line;
        buffer.clear();
        buffer.extend_from_slice(&self.pending);
        self.pending = buffer;
    }

    fn line(&mut self, line: &[u8], emit: &mut impl FnMut(String)) {
        if self.lines < self.max_lines && self.bytes + line.len() <= self.max_bytes {
            self.lines += 1;
            self.bytes += line.len();
            emit(String::from_utf8_lossy(line).trim_end().to_owned());
        } else {
            self.dropped_lines += 1;
            self.dropped_bytes += line.len() as u64;
        }
    }
}

/// Where to cut `bytes` so that no UTF-8 character is split: before a sequence the end cuts
/// short, else at the end.
fn char_boundary(bytes: &[u8]) -> usize {
    for back in 1..=3.min(bytes.len()) {
        let at = bytes.len() - back;
        let byte = bytes[at];
        if byte & 0xc0 == 0x80 {
            continue;
        }
        let width = match byte {
            0xf0..=0xf7 => 4,
            0xe0..=0xef => 3,
            0xc0..=0xdf => 2,
            _ => 1,
        };
        return if width > back && at > 0 {
            at
        } else {
            bytes.len()
        };
    }
    bytes.len()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn run(output: &mut StepOutput, chunks: &[&[u8]]) -> Vec<String> {
        let mut lines = Vec::new();
        for chunk in chunks {
            output.push(chunk, |l| lines.push(l));
        }
        lines
    }

    #[test]
    fn lines_end_at_newlines_whatever_the_chunks() {
        let mut out = StepOutput::new(100);
        let mut lines = run(&mut out, &[b"one\ntw", b"o\r\n", b"\nthree"]);
        assert_eq!(out.finish(|l| lines.push(l)), None);
        assert_eq!(lines, ["one", "two", "", "three"]);
    }

    #[test]
    fn long_lines_are_split_and_a_line_of_the_longest_length_is_one() {
        let mut out = StepOutput::with_limits(100, 1 << 20, 8);
        let mut lines = run(
            &mut out,
            &[b"12345678\n", b"abcdefghij", b"klmnopqrstuvwxyz", b"!"],
        );
        assert_eq!(out.finish(|l| lines.push(l)), None);
        assert_eq!(
            lines,
            ["12345678", "abcdefgh", "ijklmnop", "qrstuvwx", "yz!"]
        );
    }

    #[test]
    fn splits_never_cut_a_character() {
        let mut out = StepOutput::with_limits(100, 1 << 20, 8);
        // "é" is two bytes and "€" three: the first would straddle byte 8.
        let text = "abcdefgé€€\n";
        let mut lines = run(&mut out, &[text.as_bytes()]);
        assert_eq!(out.finish(|l| lines.push(l)), None);
        assert_eq!(lines, ["abcdefg", "é€€"]);
        assert_eq!(char_boundary("ab€".as_bytes()), 5);
        assert_eq!(char_boundary(&"ab€".as_bytes()[..4]), 2);
        // Not UTF-8 at all: cut where the line is full.
        assert_eq!(char_boundary(&[0xff; 8]), 8);
    }

    #[test]
    fn a_step_keeps_a_bounded_log_and_says_what_it_dropped() {
        let mut out = StepOutput::with_limits(3, 12, 8);
        let mut lines = run(&mut out, &[b"a\nb\nc\nd\ne\n"]);
        let note = out.finish(|l| lines.push(l)).unwrap();
        assert_eq!(lines, ["a", "b", "c"]);
        assert!(
            note.starts_with("2 more output lines (2 bytes) not kept"),
            "{note}"
        );
        assert!(note.contains("at most 3 lines and 12 bytes"), "{note}");

        let mut out = StepOutput::with_limits(100, 12, 8);
        let mut lines = run(&mut out, &[&[b'x'; 40]]);
        let note = out.finish(|l| lines.push(l)).unwrap();
        assert_eq!(lines, ["xxxxxxxx"]);
        assert!(note.starts_with("4 more output lines (32 bytes)"), "{note}");
    }

    #[test]
    fn memory_stays_bounded_however_much_is_printed_without_a_newline() {
        let mut out = StepOutput::new(5000);
        let chunk = vec![b'a'; 32 << 10];
        let mut kept = 0usize;
        let mut longest = 0usize;
        for _ in 0..(64 << 20) / chunk.len() {
            out.push(&chunk, |l| {
                kept += 1;
                longest = longest.max(l.len());
            });
            assert!(out.pending.capacity() <= MAX_LINE_BYTES * 2);
        }
        assert_eq!(longest, MAX_LINE_BYTES);
        assert_eq!(kept, MAX_STEP_BYTES / MAX_LINE_BYTES);
        let note = out.finish(|_| {}).unwrap();
        let dropped = (64 << 20) / MAX_LINE_BYTES - kept;
        assert!(
            note.starts_with(&format!("{dropped} more output lines")),
            "{note}"
        );
    }
}
