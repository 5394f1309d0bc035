//! Answers read from the store, kept in memory for as long as the store's lookup generation
//! (see [`LookupGenerations`](crate::store::LookupGenerations)) stays where it was when they
//! were read. What every create reads (its key's team, its template) then costs one read of
//! the generation, or none, instead of the records.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;

/// Most answers kept: past it, everything is dropped and read again. Only answers that found
/// something are kept, so it bounds what the valid keys and templates in use take.
const CAPACITY: usize = 4096;

#[derive(Debug)]
pub(crate) struct LookupCache<K, V> {
    state: Mutex<State<K, V>>,
}

#[derive(Debug)]
struct State<K, V> {
    generation: u64,
    /// How many times this process dropped everything for a change it made itself: an
    /// answer read before that must not be kept, whatever the generation says.
    forgotten: u64,
    answers: HashMap<K, V>,
}

/// A lookup that found nothing cached, and what its answer may be kept under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Miss {
    generation: u64,
    forgotten: u64,
}

impl<K: Eq + Hash, V: Clone> Default for LookupCache<K, V> {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                generation: 0,
                forgotten: 0,
                answers: HashMap::new(),
            }),
        }
    }
}

impl<K: Eq + Hash, V: Clone> LookupCache<K, V> {
    /// The answer cached for `key` under `generation`, read from the store just before.
    pub(crate) fn get<Q>(&self, generation: u64, key: &Q) -> Result<V, Miss>
    where
        K: Borrow<Q>,
        Q: Eq + Hash + ?Sized,
    {
        let mut state = crate::lock(&self.state);
        if generation > state.generation {
            state.generation = generation;
            state.answers.clear();
        }
        let miss = Miss {
            generation,
            forgotten: state.forgotten,
        };
        if generation < state.generation {
            // A lookup that read the generation before a newer one did: its answer is read
            // again from the store, and not kept.
            return Err(miss);
        }
        state.answers.get(key).cloned().ok_or(miss)
    }

    /// Keeps `value`, read from the store after `miss`, unless the generation moved on or this
    /// process changed what it depends on since.
    pub(crate) fn put(&self, miss: Miss, key: K, value: V) {
        let mut state = crate::lock(&self.state);
        if state.generation != miss.generation || state.forgotten != miss.forgotten {
            return;
        }
        if state.answers.len() >= CAPACITY {
            state.answers.clear();
        }
        state.answers.insert(key, value);
    }

    /// Changes the answer kept for `key`, if one is.
    pub(crate) fn update<Q>(&self, key: &Q, change: impl FnOnce(&mut V))
    where
        K: Borrow<Q>,
        Q: Eq + Hash + ?Sized,
    {
        if let Some(value) = crate::lock(&self.state).answers.get_mut(key) {
            change(value);
        }
    }

    /// Drops every answer, for a change this process just made: the store's generation
    /// follows it, but a database that notifies may tell this process a moment later.
    pub(crate) fn forget_all(&self) {
        let mut state = crate::lock(&self.state);
        state.forgotten += 1;
        state.answers.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache() -> LookupCache<String, u32> {
        LookupCache::default()
    }

    fn fill(cache: &LookupCache<String, u32>, generation: u64, key: &str, value: u32) {
        let miss = cache.get(generation, key).expect_err("nothing cached yet");
        cache.put(miss, key.to_owned(), value);
    }

    fn missed(generation: u64, forgotten: u64) -> Result<u32, Miss> {
        Err(Miss {
            generation,
            forgotten,
        })
    }

    #[test]
    fn an_answer_is_kept_while_the_generation_holds() {
        let cache = cache();
        fill(&cache, 3, "k", 7);
        assert_eq!(cache.get(3, "k"), Ok(7));
        assert_eq!(cache.get(3, "other"), missed(3, 0));
    }

    #[test]
    fn a_new_generation_drops_every_answer() {
        let cache = cache();
        fill(&cache, 3, "k", 7);
        assert_eq!(cache.get(4, "k"), missed(4, 0));
        // Not back under the old generation either.
        assert_eq!(cache.get(3, "k"), missed(3, 0));
    }

    #[test]
    fn an_answer_read_under_an_older_generation_is_not_kept() {
        let cache = cache();
        let slow = cache.get(3, "k").expect_err("empty");
        assert_eq!(cache.get(4, "other"), missed(4, 0));
        cache.put(slow, "k".to_owned(), 7);
        assert_eq!(cache.get(4, "k"), missed(4, 0));
        // A lookup still on the older generation is not answered from the cache.
        assert_eq!(cache.get(3, "k"), missed(3, 0));
    }

    #[test]
    fn an_answer_read_before_this_process_changed_the_records_is_not_kept() {
        let cache = cache();
        fill(&cache, 3, "a", 1);
        let before_revoke = cache.get(3, "k").expect_err("empty");
        cache.forget_all();
        cache.put(before_revoke, "k".to_owned(), 7);
        assert_eq!(cache.get(3, "k"), missed(3, 1));
        assert_eq!(
            cache.get(3, "a"),
            missed(3, 1),
            "forgetting drops what was kept"
        );
        fill(&cache, 3, "k", 8);
        assert_eq!(cache.get(3, "k"), Ok(8));
    }

    #[test]
    fn an_update_changes_only_a_kept_answer() {
        let cache = cache();
        fill(&cache, 1, "k", 7);
        cache.update("k", |v| *v += 1);
        cache.update("absent", |v| *v += 1);
        assert_eq!(cache.get(1, "k"), Ok(8));
        assert_eq!(cache.get(1, "absent"), missed(1, 0));
    }

    #[test]
    fn a_full_cache_starts_over_instead_of_growing() {
        let cache = cache();
        for i in 0..CAPACITY {
            fill(&cache, 1, &i.to_string(), 0);
        }
        fill(&cache, 1, "one more", 1);
        assert_eq!(cache.get(1, "one more"), Ok(1));
        assert_eq!(cache.get(1, "0"), missed(1, 0));
        assert_eq!(crate::lock(&cache.state).answers.len(), 1);
    }
}
