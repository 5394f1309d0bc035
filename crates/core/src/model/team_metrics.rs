//! A team's activity as recorded, in 5-second buckets.

/// One stored bucket of a team's activity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TeamMetricBucket {
    pub team_id: String,
    /// Start of the bucket, a multiple of [`BUCKET_SECS`] in Unix seconds.
    pub bucket: i64,
    /// The most sandboxes the team had running at once in the bucket.
    pub concurrent: u32,
    pub starts: u32,
}
