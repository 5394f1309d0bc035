//! Limits on what a client may attach to a sandbox or a build: environment variable names and
//! sandbox metadata. E2B documents limits for secrets' metadata only; sandboxes get the same
//! (32 entries, keys of 128 bytes, values of 1024 bytes, 8192 bytes in all), which keeps a
//! sandbox's row and its list answers small.

use std::collections::BTreeMap;

pub const MAX_METADATA_ENTRIES: usize = 32;
pub const MAX_METADATA_KEY_BYTES: usize = 128;
pub const MAX_METADATA_VALUE_BYTES: usize = 1024;
pub const MAX_METADATA_BYTES: usize = 8192;
pub const MAX_ENV_NAME_BYTES: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    #[error(
        "invalid environment variable name '{0}': a name is 1 to 256 bytes with no '=', whitespace or control characters"
    )]
    EnvName(String),
    #[error("metadata has {0} entries, more than the limit of {MAX_METADATA_ENTRIES}")]
    MetadataEntries(usize),
    #[error(
        "metadata key '{0}' is empty or longer than the limit of {MAX_METADATA_KEY_BYTES} bytes"
    )]
    MetadataKey(String),
    #[error(
        "metadata value of '{key}' is {len} bytes, more than the limit of {MAX_METADATA_VALUE_BYTES}"
    )]
    MetadataValue { key: String, len: usize },
    #[error("metadata is {0} bytes in all, more than the limit of {MAX_METADATA_BYTES}")]
    MetadataTotal(usize),
}

/// Refuses a name no shell or `env` could hand on as one variable.
pub fn check_env_name(name: &str) -> Result<(), InputError> {
    let bad = name.is_empty()
        || name.len() > MAX_ENV_NAME_BYTES
        || name
            .chars()
            .any(|c| c == '=' || c.is_whitespace() || c.is_control());
    if bad {
        // The name is echoed back: cut and escaped so the error stays one readable line.
        let shown: String = name.chars().take(64).flat_map(char::escape_debug).collect();
        return Err(InputError::EnvName(shown));
    }
    Ok(())
}

pub fn check_env_names<'a>(names: impl IntoIterator<Item = &'a String>) -> Result<(), InputError> {
    names.into_iter().try_for_each(|n| check_env_name(n))
}

pub fn check_metadata(metadata: &BTreeMap<String, String>) -> Result<(), InputError> {
    if metadata.len() > MAX_METADATA_ENTRIES {
        return Err(InputError::MetadataEntries(metadata.len()));
    }
    let mut total = 0;
    for (key, value) in metadata {
        if key.is_empty() || key.len() > MAX_METADATA_KEY_BYTES {
            let shown: String = key.chars().take(64).collect();
            return Err(InputError::MetadataKey(shown));
        }
        if value.len() > MAX_METADATA_VALUE_BYTES {
            return Err(InputError::MetadataValue {
                key: key.clone(),
                len: value.len(),
            });
        }
        total += key.len() + value.len();
    }
    if total > MAX_METADATA_BYTES {
        return Err(InputError::MetadataTotal(total));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinary_names_pass_and_broken_ones_are_refused() {
        for good in ["PATH", "my_var", "A1", "lower.case-ok"] {
            assert_eq!(check_env_name(good), Ok(()), "{good}");
        }
        for bad in ["", "A=B", "A B", "A\nB", "A\0", "\tX"] {
            let result = check_env_name(bad);
            assert!(
                matches!(result, Err(InputError::EnvName(_))),
                "{bad:?}: {result:?}"
            );
        }
        // An over-long name is refused and echoed back cut short.
        assert_eq!(
            check_env_name(&"x".repeat(257)),
            Err(InputError::EnvName("x".repeat(64)))
        );
        let shown = check_env_name("A\nB").expect_err("refused").to_string();
        assert!(shown.contains("A\\nB"), "{shown}");
    }

    #[test]
    fn metadata_limits_are_each_enforced() {
        let entries = |n: usize, value: &str| -> BTreeMap<String, String> {
            (0..n)
                .map(|i| (format!("k{i}"), value.to_owned()))
                .collect()
        };
        assert_eq!(check_metadata(&entries(32, "v")), Ok(()));
        assert_eq!(
            check_metadata(&entries(33, "v")),
            Err(InputError::MetadataEntries(33))
        );
        assert!(matches!(
            check_metadata(&entries(1, &"v".repeat(1025))),
            Err(InputError::MetadataValue { len: 1025, .. })
        ));
        assert!(matches!(
            check_metadata(&entries(10, &"v".repeat(1000))),
            Err(InputError::MetadataTotal(_))
        ));
        let long_key = BTreeMap::from([("k".repeat(129), String::new())]);
        assert!(matches!(
            check_metadata(&long_key),
            Err(InputError::MetadataKey(_))
        ));
    }
}
