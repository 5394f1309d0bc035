//! Identifier and secret formats, matching E2B's so clients that validate them accept ours.

use rand::Rng;
use rand::distr::Alphanumeric;

fn lowercase_alphanumeric(len: usize) -> String {
    rand::rng()
        .sample_iter(&Alphanumeric)
        .map(|c| (c as char).to_ascii_lowercase())
        .take(len)
        .collect()
}

/// `i` followed by 20 characters of `[a-z0-9]`, like E2B's sandbox IDs.
pub fn new_sandbox_id() -> String {
    format!("i{}", lowercase_alphanumeric(20))
}

/// 20 characters of `[a-z0-9]`, like E2B's template IDs.
pub fn new_template_id() -> String {
    lowercase_alphanumeric(20)
}

/// Whether `s` has the form of a template ID ([`new_template_id`]): a name of any other form
/// needs no lookup by ID.
pub fn is_template_id(s: &str) -> bool {
    s.len() == 20
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// Whether `s` is 1 to `max` bytes long, each an ASCII letter, a digit or one of `also`: the
/// form of the names that stand in URLs, paths and logs without quoting.
pub(crate) fn is_plain_name(s: &str, max: usize, also: &[u8]) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || also.contains(&b))
}

/// A random UUID (version 4) in its canonical text form.
pub fn new_uuid() -> String {
    let mut b: [u8; 16] = rand::rng().random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// A random machine id as `/etc/machine-id` holds one: a version 4 UUID's 32 lowercase hex
/// digits, as systemd makes them.
pub fn new_machine_id() -> String {
    new_uuid().replace('-', "")
}

/// `prefix` followed by 40 lowercase hex characters (160 random bits).
pub fn new_secret(prefix: &str) -> String {
    let b: [u8; 20] = rand::rng().random();
    format!("{prefix}{}", hex::encode(b))
}

/// Whether `value` is `prefix` followed by exactly 40 lowercase hex characters.
pub fn is_well_formed_secret(value: &str, prefix: &str) -> bool {
    value.strip_prefix(prefix).is_some_and(|rest| {
        rest.len() == 40 && rest.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
    })
}

pub const API_KEY_PREFIX: &str = "e2b_";
pub const ACCESS_TOKEN_PREFIX: &str = "sk_e2b_";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_names_of_the_template_id_form_are_taken_for_ids() {
        for _ in 0..100 {
            assert!(is_template_id(&new_template_id()));
        }
        for name in [
            "base",
            "code-interpreter-v1",
            "Abcdefghij0123456789",
            "abcdefghij012345678",
            "abcdefghij0123456789a",
            "team/abcdefghij012345",
        ] {
            assert!(!is_template_id(name), "{name}");
        }
    }

    #[test]
    fn sandbox_ids_have_e2b_shape() {
        let id = new_sandbox_id();
        assert_eq!(id.len(), 21);
        assert!(id.starts_with('i'));
        assert!(
            id.bytes()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        );
    }

    #[test]
    fn secrets_round_trip_their_format_check() {
        let key = new_secret(API_KEY_PREFIX);
        assert!(is_well_formed_secret(&key, API_KEY_PREFIX));
        assert!(!is_well_formed_secret(&key, ACCESS_TOKEN_PREFIX));
        assert!(!is_well_formed_secret("e2b_ABC", API_KEY_PREFIX));
        assert!(!is_well_formed_secret(&format!("{key}0"), API_KEY_PREFIX));
    }

    #[test]
    fn uuids_are_version_4() {
        let id = new_uuid();
        assert_eq!(id.len(), 36);
        assert_eq!(&id[14..15], "4");
    }
}
