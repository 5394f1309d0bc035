//! Pieces of E2B's envd protocol that both the agent and the edge in front of it need, so the
//! two never disagree: the signature on download/upload URLs and how secrets are compared.

use base64::Engine as _;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Compares two secrets without leaking the position of the first difference.
pub fn secrets_equal(a: &str, b: &str) -> bool {
    a.as_bytes().ct_eq(b.as_bytes()).into()
}

/// Which side of a file transfer a signature grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileOperation {
    /// `GET /files`.
    Read,
    /// `POST /files`.
    Write,
}

impl FileOperation {
    fn as_str(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Write => "write",
        }
    }
}

/// The signature the SDKs put on download/upload URLs:
/// `v1_` + unpadded base64 of SHA-256 over `path:operation:user:token[:expiration]`.
pub fn file_signature(
    path: &str,
    operation: FileOperation,
    username: &str,
    token: &str,
    expiration: Option<i64>,
) -> String {
    let mut payload = format!("{path}:{}:{username}:{token}", operation.as_str());
    if let Some(exp) = expiration {
        payload.push_str(&format!(":{exp}"));
    }
    let digest = Sha256::digest(payload.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// Why a signed URL was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SignatureError {
    /// `signature_expiration` lies in the past (for the path named). Worded exactly as envd
    /// words it, without the path: clients compare the whole message.
    #[error("signature is already expired")]
    Expired(String),
    /// The signature does not match.
    #[error("invalid signature for '{0}'")]
    Mismatch(String),
}

/// Checks a signed URL. The SDKs sign with the `username` they put in the query, which is
/// empty when the caller relies on the default user; both spellings are accepted.
pub fn verify_file_signature(
    signature: &str,
    path: &str,
    operation: FileOperation,
    usernames: &[&str],
    token: &str,
    expiration: Option<i64>,
    now_unix: i64,
) -> Result<(), SignatureError> {
    if let Some(exp) = expiration
        && exp < now_unix
    {
        return Err(SignatureError::Expired(path.to_owned()));
    }
    // An unencoded `+` in a query string decodes to a space; undo that for hand-built URLs.
    let signature = signature.replace(' ', "+");
    let ok = usernames.iter().any(|user| {
        secrets_equal(
            &signature,
            &file_signature(path, operation, user, token, expiration),
        )
    });
    if ok {
        Ok(())
    } else {
        Err(SignatureError::Mismatch(path.to_owned()))
    }
}

/// Whether `signature` was made with `token` for this path, operation and one of `usernames`,
/// whatever its expiration: the edge uses it to find the sandbox a signed URL belongs to, and
/// leaves refusing an expired one to the agent, whose answer says so.
pub fn signature_matches(
    signature: &str,
    path: &str,
    operation: FileOperation,
    usernames: &[&str],
    token: &str,
    expiration: Option<i64>,
) -> bool {
    verify_file_signature(
        signature,
        path,
        operation,
        usernames,
        token,
        expiration,
        i64::MIN,
    )
    .is_ok()
}

/// One signed URL's signature, checked against candidate tokens: the part of the hashed text
/// before the token (`path:operation:user:`, whose path the caller chose and may make long)
/// is hashed once, so each token costs a hash of its own few bytes. For finding which of
/// many sandboxes made a signature when the URL names none.
#[derive(Clone)]
pub struct SignatureCheck {
    before_token: Sha256,
    after_token: String,
    /// The signature's digest; `None` when it is not one (no token can match then).
    expected: Option<[u8; 32]>,
}

impl std::fmt::Debug for SignatureCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SignatureCheck")
            .field("well_formed", &self.expected.is_some())
            .finish_non_exhaustive()
    }
}

impl SignatureCheck {
    pub fn new(
        signature: &str,
        path: &str,
        operation: FileOperation,
        username: &str,
        expiration: Option<i64>,
    ) -> Self {
        // An unencoded `+` in a query string decodes to a space; undo that for hand-built URLs.
        let expected = signature
            .replace(' ', "+")
            .strip_prefix("v1_")
            .and_then(|encoded| {
                base64::engine::general_purpose::STANDARD_NO_PAD
                    .decode(encoded)
                    .ok()
            })
            .and_then(|digest| <[u8; 32]>::try_from(digest).ok());
        let mut before_token = Sha256::new();
        before_token.update(format!("{path}:{}:{username}:", operation.as_str()).as_bytes());
        Self {
            before_token,
            after_token: expiration.map(|exp| format!(":{exp}")).unwrap_or_default(),
            expected,
        }
    }

    /// Whether `token` made the signature (compared in constant time).
    pub fn made_with(&self, token: &str) -> bool {
        let Some(expected) = &self.expected else {
            return false;
        };
        let mut hasher = self.before_token.clone();
        hasher.update(token.as_bytes());
        hasher.update(self.after_token.as_bytes());
        hasher.finalize().as_slice().ct_eq(expected).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "0123456789abcdef";

    #[test]
    fn a_signature_check_agrees_with_the_signature() {
        for (user, exp) in [("", None), ("user", Some(2_000)), ("root", Some(-5))] {
            let sig = file_signature("/a b", FileOperation::Read, user, TOKEN, exp);
            let check = SignatureCheck::new(&sig, "/a b", FileOperation::Read, user, exp);
            assert!(check.made_with(TOKEN));
            assert!(!check.made_with("another-token"));
            // A signature typed into a URL by hand, its `+` turned into a space.
            let typed = SignatureCheck::new(
                &sig.replace('+', " "),
                "/a b",
                FileOperation::Read,
                user,
                exp,
            );
            assert!(typed.made_with(TOKEN));
            for (path, op, u, e) in [
                ("/a", FileOperation::Read, user, exp),
                ("/a b", FileOperation::Write, user, exp),
                ("/a b", FileOperation::Read, "other", exp),
                ("/a b", FileOperation::Read, user, Some(1)),
            ] {
                assert!(!SignatureCheck::new(&sig, path, op, u, e).made_with(TOKEN));
            }
        }
        for malformed in ["", "v1_", "v2_abc", "v1_not base64!", "v1_AAAA"] {
            let check = SignatureCheck::new(malformed, "/a", FileOperation::Read, "", None);
            assert!(!check.made_with(TOKEN), "{malformed}");
        }
    }

    #[test]
    fn signature_has_the_sdk_format() {
        let sig = file_signature("/home/user/a.txt", FileOperation::Read, "user", TOKEN, None);
        assert!(sig.starts_with("v1_"));
        assert!(!sig.ends_with('='));
        assert_eq!(sig.len(), 3 + 43);
    }

    #[test]
    fn verification_checks_every_part() {
        let now = 1_000;
        let sig = file_signature("/a", FileOperation::Write, "user", TOKEN, Some(2_000));
        let check = |sig: &str, path, op, users: &[&str], token, exp| {
            verify_file_signature(sig, path, op, users, token, exp, now)
        };
        assert_eq!(
            check(
                &sig,
                "/a",
                FileOperation::Write,
                &["user"],
                TOKEN,
                Some(2_000)
            ),
            Ok(())
        );
        for (path, op, user, token, exp) in [
            ("/b", FileOperation::Write, "user", TOKEN, Some(2_000)),
            ("/a", FileOperation::Read, "user", TOKEN, Some(2_000)),
            ("/a", FileOperation::Write, "root", TOKEN, Some(2_000)),
            (
                "/a",
                FileOperation::Write,
                "user",
                "other-token",
                Some(2_000),
            ),
            ("/a", FileOperation::Write, "user", TOKEN, Some(3_000)),
            ("/a", FileOperation::Write, "user", TOKEN, None),
        ] {
            assert!(
                matches!(
                    check(&sig, path, op, &[user], token, exp),
                    Err(SignatureError::Mismatch(_))
                ),
                "{path} {op:?} {user} {token} {exp:?}"
            );
        }
        assert!(matches!(
            check(
                "v1_not-base64!",
                "/a",
                FileOperation::Write,
                &["user"],
                TOKEN,
                Some(2_000)
            ),
            Err(SignatureError::Mismatch(_))
        ));
    }

    #[test]
    fn expired_signatures_are_refused_but_still_routable() {
        let sig = file_signature("/a", FileOperation::Read, "", TOKEN, Some(500));
        assert!(matches!(
            verify_file_signature(
                &sig,
                "/a",
                FileOperation::Read,
                &["user", ""],
                TOKEN,
                Some(500),
                1_000
            ),
            Err(SignatureError::Expired(_))
        ));
        assert!(signature_matches(
            &sig,
            "/a",
            FileOperation::Read,
            &["user", ""],
            TOKEN,
            Some(500)
        ));
    }

    #[test]
    fn a_space_stands_for_plus() {
        let sig = file_signature("/x", FileOperation::Read, "user", TOKEN, None);
        let spaced = sig.replace('+', " ");
        assert!(signature_matches(
            &spaced,
            "/x",
            FileOperation::Read,
            &["user"],
            TOKEN,
            None
        ));
    }
}
