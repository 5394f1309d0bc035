//! Percentiles over latency samples.

use std::time::Duration;

/// Summary of a set of latency samples, in milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct Summary {
    pub n: usize,
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
    pub mean: f64,
    pub min: f64,
    pub max: f64,
}

/// A duration in milliseconds, as every table here prints it.
pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Nearest-rank percentile of sorted samples (`p` in 0..=100).
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Summarizes samples; `None` when there are none.
pub fn summarize(samples: &[Duration]) -> Option<Summary> {
    if samples.is_empty() {
        return None;
    }
    let mut sorted: Vec<f64> = samples.iter().copied().map(ms).collect();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    Some(Summary {
        n,
        p50: percentile(&sorted, 50.0),
        p90: percentile(&sorted, 90.0),
        p95: percentile(&sorted, 95.0),
        p99: percentile(&sorted, 99.0),
        mean: sorted.iter().sum::<f64>() / n as f64,
        min: sorted[0],
        max: sorted[n - 1],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let s = summarize(&samples).expect("samples");
        assert_eq!(s.n, 100);
        assert!((s.p50 - 50.0).abs() < 1e-9);
        assert!((s.p90 - 90.0).abs() < 1e-9);
        assert!((s.p95 - 95.0).abs() < 1e-9);
        assert!((s.p99 - 99.0).abs() < 1e-9);
        assert!((s.min - 1.0).abs() < 1e-9);
        assert!((s.max - 100.0).abs() < 1e-9);
        assert!((s.mean - 50.5).abs() < 1e-9);
    }

    #[test]
    fn single_sample() {
        let s = summarize(&[Duration::from_millis(7)]).expect("one sample");
        assert!((s.p50 - 7.0).abs() < 1e-9 && (s.p99 - 7.0).abs() < 1e-9);
        assert!(summarize(&[]).is_none());
    }
}
