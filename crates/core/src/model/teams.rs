//! Teams and the limits set on them.

/// A team owns every other resource; its limits are per team so operators can set them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Team {
    pub id: String,
    pub name: String,
    /// The team's namespace in template and snapshot names (`slug/name:tag`): unique, made
    /// from the name when the team is made.
    pub slug: String,
    pub max_concurrent_sandboxes: u32,
    pub max_sandbox_timeout_secs: u64,
    /// API requests allowed per minute; 0 means no limit.
    pub requests_per_minute: u32,
    /// Ceilings on one sandbox's resources; 0 leaves only the server's own limits.
    pub max_vcpu: u32,
    pub max_memory_mb: u32,
    pub max_disk_mb: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TeamLimits {
    pub max_concurrent_sandboxes: u32,
    pub max_sandbox_timeout_secs: u64,
    /// 0 means no limit.
    pub requests_per_minute: u32,
    /// Per-sandbox ceilings; 0 leaves only the server's own limits.
    pub max_vcpu: u32,
    pub max_memory_mb: u32,
    pub max_disk_mb: u32,
}

/// A slug made from a team's name: lower-case letters and digits, runs of anything else
/// made one `-`, at most 48 bytes; `team` when nothing is left.
pub fn slug_of(name: &str) -> String {
    let mut slug = String::new();
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            slug.push(c.to_ascii_lowercase());
        } else if !slug.ends_with('-') && !slug.is_empty() {
            slug.push('-');
        }
        if slug.len() >= 48 {
            break;
        }
    }
    let slug = slug.trim_end_matches('-');
    if slug.is_empty() {
        "team".to_owned()
    } else {
        slug.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::slug_of;

    #[test]
    fn slugs_are_lower_case_letters_digits_and_single_dashes() {
        assert_eq!(slug_of("Acme Corp"), "acme-corp");
        assert_eq!(slug_of("  --Team__42!!"), "team-42");
        assert_eq!(slug_of("日本"), "team");
        assert_eq!(slug_of(&"a".repeat(100)).len(), 48);
    }
}
