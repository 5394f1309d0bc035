//! A team's sandbox activity over time: how many ran at once and how fast they started.
//!
//! The server keeps 5-second buckets; reads fold them into steps sized to the interval so a
//! response never holds more than about [`MAX_POINTS`] points.

use chrono::{DateTime, Utc};

use crate::store::StoreError;

/// Width of a stored bucket, in seconds.
pub const BUCKET_SECS: i64 = 5;
/// Most points a series read returns.
pub const MAX_POINTS: i64 = 720;
const STEPS: [i64; 10] = [5, 15, 30, 60, 120, 300, 900, 1800, 3600, 86_400];

pub use crate::model::team_metrics::TeamMetricBucket;

/// One point of `GET /teams/{teamID}/metrics`.
#[derive(Debug, Clone, PartialEq)]
pub struct TeamMetricPoint {
    pub at: DateTime<Utc>,
    pub concurrent_sandboxes: u32,
    /// Sandboxes started per second over the point's step.
    pub sandbox_start_rate: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TeamMetric {
    ConcurrentSandboxes,
    SandboxStartRate,
}

impl TeamMetric {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "concurrent_sandboxes" => Some(Self::ConcurrentSandboxes),
            "sandbox_start_rate" => Some(Self::SandboxStartRate),
            _ => None,
        }
    }
}

/// The largest value of a metric in an interval and when it was reached.
#[derive(Debug, Clone, PartialEq)]
pub struct TeamMetricMax {
    pub at: DateTime<Utc>,
    pub value: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum TeamMetricsError {
    /// Another team's ID and an unknown one look the same, so neither is confirmed to exist.
    #[error("team '{0}' is not the team of this API key")]
    OtherTeam(String),
    #[error("start {start} is after end {end}")]
    StartAfterEnd { start: i64, end: i64 },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The smallest step that keeps `[start, end]` within [`MAX_POINTS`] points.
pub fn step_for(start: i64, end: i64) -> i64 {
    let span = (end - start).max(0);
    STEPS
        .into_iter()
        .find(|step| span / step < MAX_POINTS)
        .unwrap_or(STEPS[STEPS.len() - 1])
}

/// Folds stored buckets (sorted by time) into one point per step from `start` to `end`,
/// zeros where nothing ran.
pub fn fold(buckets: &[TeamMetricBucket], start: i64, end: i64) -> Vec<TeamMetricPoint> {
    if start > end {
        return Vec::new();
    }
    let step = step_for(start, end);
    let first = start.div_euclid(step) * step;
    let mut points = Vec::new();
    let mut remaining = buckets.iter().peekable();
    let mut at = first;
    while at <= end {
        let mut concurrent = 0;
        let mut starts = 0u64;
        while let Some(b) = remaining.next_if(|b| b.bucket < at + step) {
            if b.bucket >= at {
                concurrent = concurrent.max(b.concurrent);
                starts += u64::from(b.starts);
            }
        }
        points.push(TeamMetricPoint {
            at: DateTime::from_timestamp(at, 0).unwrap_or_default(),
            concurrent_sandboxes: concurrent,
            sandbox_start_rate: starts as f64 / step as f64,
        });
        at += step;
    }
    points
}

/// The largest value of `metric` among `points`; the first point reaching it, or `end` with
/// 0 when there are none.
pub fn max_of(points: &[TeamMetricPoint], metric: TeamMetric, end: i64) -> TeamMetricMax {
    let value = |p: &TeamMetricPoint| match metric {
        TeamMetric::ConcurrentSandboxes => f64::from(p.concurrent_sandboxes),
        TeamMetric::SandboxStartRate => p.sandbox_start_rate,
    };
    let mut best = TeamMetricMax {
        at: DateTime::from_timestamp(end, 0).unwrap_or_default(),
        value: 0.0,
    };
    let mut found = false;
    for p in points {
        if !found || value(p) > best.value {
            best = TeamMetricMax {
                at: p.at,
                value: value(p),
            };
            found = true;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket(at: i64, concurrent: u32, starts: u32) -> TeamMetricBucket {
        TeamMetricBucket {
            team_id: "t".into(),
            bucket: at,
            concurrent,
            starts,
        }
    }

    #[test]
    fn steps_grow_with_the_interval() {
        assert_eq!(step_for(0, 60), 5);
        assert_eq!(step_for(0, 3599), 5);
        assert_eq!(step_for(0, 3600), 15);
        assert_eq!(step_for(0, 7 * 86_400), 900);
        assert!((7 * 86_400) / step_for(0, 7 * 86_400) < MAX_POINTS);
    }

    #[test]
    fn buckets_fold_into_points_with_zeros_between() {
        let points = fold(&[bucket(10, 2, 1), bucket(20, 3, 4)], 0, 24);
        assert_eq!(points.len(), 5);
        assert_eq!(points[0].concurrent_sandboxes, 0);
        assert_eq!(points[2].concurrent_sandboxes, 2);
        assert!((points[2].sandbox_start_rate - 0.2).abs() < 1e-9);
        assert_eq!(points[4].concurrent_sandboxes, 3);
        let max = max_of(&points, TeamMetric::ConcurrentSandboxes, 24);
        assert_eq!((max.at.timestamp(), max.value), (20, 3.0));
        let rate = max_of(&points, TeamMetric::SandboxStartRate, 24);
        assert!((rate.value - 0.8).abs() < 1e-9);
        assert!(fold(&[], 10, 5).is_empty());
        assert_eq!(
            max_of(&[], TeamMetric::SandboxStartRate, 7).at.timestamp(),
            7
        );
    }
}
