//! Which sandbox holds which agent token, for the edge to find the sandbox a signed file URL
//! belongs to when the URL names none (what `download_url()` gives out when the SDK has one
//! URL for every sandbox). A signature can only be checked against each token in turn, and
//! anyone may send one, so the check runs on a copy of the list taken under a lock held for
//! an `Arc` clone: never under the registry's lock, which every request to a sandbox takes.

use std::sync::{Arc, Mutex, Weak};

use crate::lock;

/// A sandbox's id and its token, held only as long as the registry holds the token.
type ListedToken = (String, Weak<str>);

/// The listed tokens. An entry lives as long as the registry entry holding its token: the
/// list keeps a weak reference, and dead ones are dropped when the next token is listed.
#[derive(Debug, Default)]
pub(crate) struct Signers {
    listed: Mutex<Arc<Vec<ListedToken>>>,
}

impl Signers {
    /// Lists `token` as sandbox `id`'s for as long as the returned token (or a clone) is
    /// held. An empty token (a sandbox still starting) signs nothing and is not listed.
    pub(crate) fn list(&self, id: &str, token: &str) -> Arc<str> {
        let token: Arc<str> = Arc::from(token);
        if token.is_empty() {
            return token;
        }
        let mut listed = lock(&self.listed);
        // Copied only if a search holds the current list.
        let entries = Arc::make_mut(&mut *listed);
        entries.retain(|(_, held)| held.strong_count() > 0);
        entries.push((id.to_owned(), Arc::downgrade(&token)));
        token
    }

    /// The sandbox whose token `made` says made a signature; no lock is held while `made`
    /// runs.
    pub(crate) fn find(&self, made: impl Fn(&str) -> bool) -> Option<String> {
        let listed = Arc::clone(&lock(&self.listed));
        listed.iter().find_map(|(id, token)| {
            let token = token.upgrade()?;
            made(&token).then(|| id.clone())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_found_while_held_and_forgotten_after() {
        let signers = Signers::default();
        let first = signers.list("a", "token-a");
        let second = signers.list("b", "token-b");
        assert!(signers.list("c", "").is_empty());
        assert_eq!(signers.find(|t| t == "token-b").as_deref(), Some("b"));
        assert_eq!(signers.find(|t| t == "token-a").as_deref(), Some("a"));
        assert_eq!(signers.find(|t| t == "token-c"), None);
        drop(first);
        assert_eq!(signers.find(|t| t == "token-a"), None);
        // Dead entries go when the next token is listed.
        let _third = signers.list("c", "token-c");
        assert_eq!(lock(&signers.listed).len(), 2);
        drop(second);
    }

    #[test]
    fn a_search_holds_no_lock_while_it_checks() {
        let signers = Signers::default();
        let _a = signers.list("a", "token-a");
        // Listing from inside a search would deadlock if the search held the lock.
        let found = signers.find(|t| {
            let _b = signers.list("b", "token-b");
            t == "token-a"
        });
        assert_eq!(found.as_deref(), Some("a"));
    }
}
