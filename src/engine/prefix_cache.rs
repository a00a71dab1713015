//! The prefix cache: saved sequence states (backend snapshots), found again by the tokens that
//! produced them.
//!
//! Gated-DeltaNet layers fold the whole history into a fixed-size recurrent state, which cannot
//! be cut back to a shorter prefix the way a KV cache can. So instead of sharing KV blocks, the
//! engine saves complete states at a few points of a sequence (every `snapshot_interval` prompt
//! tokens, before the prompt's last token, at the end of the turn) and a later request whose prompt
//! starts with the same tokens restores the longest such state and reads only the rest.
//!
//! Entries are keyed by a hash of their token prefix, seeded with the request's
//! `prompt_cache_key` (requests with different keys never share states; requests without one
//! share a common space). A hash match is confirmed by comparing the tokens. Entries are evicted
//! least recently used first to keep the memory they hold (snapshot bytes as the backend reports
//! them, plus the key tokens) within the budget. The cache only does the bookkeeping: it hands
//! back the ids of evicted snapshots, and the caller frees them in the backend.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use crate::model::{Snapshot, SnapshotId};

/// A cache hit: restore `snapshot`, then the first `tokens` prompt tokens are done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachedPrefix {
    pub snapshot: SnapshotId,
    pub tokens: usize,
}

struct Entry {
    namespace: u64,
    tokens: Vec<u32>,
    snapshot: Snapshot,
    /// Key in `by_age`.
    last_used: u64,
}

impl Entry {
    fn bytes(&self) -> u64 {
        self.snapshot.bytes + (self.tokens.len() * std::mem::size_of::<u32>()) as u64
    }
}

pub struct PrefixCache {
    budget: u64,
    used: u64,
    /// Prefix hash → entry.
    entries: HashMap<u64, Entry>,
    /// Use clock → prefix hash: the least recently used entry first.
    by_age: BTreeMap<u64, u64>,
    /// Token count → entries of that many tokens: a lookup probes only these prefix lengths
    /// (a probe at every token of a 30K-token prompt took ≈ 0.5 ms, v1.83).
    lengths: BTreeMap<usize, usize>,
    clock: u64,
}

impl PrefixCache {
    /// An empty cache that holds at most `budget` bytes.
    pub fn new(budget: u64) -> PrefixCache {
        PrefixCache {
            budget,
            used: 0,
            entries: HashMap::new(),
            by_age: BTreeMap::new(),
            lengths: BTreeMap::new(),
            clock: 0,
        }
    }

    /// Bytes held by the entries.
    pub fn bytes(&self) -> u64 {
        self.used
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The longest cached prefix of `prompt` no longer than `max_tokens`, marked as just used.
    pub fn lookup(
        &mut self,
        key: Option<&str>,
        prompt: &[u32],
        max_tokens: usize,
    ) -> Option<CachedPrefix> {
        let namespace = namespace(key);
        let mut hash = namespace;
        let mut best = None;
        if max_tokens == 0 {
            return None; // (and `1..=0` below would panic)
        }
        let mut lengths = self
            .lengths
            .range(1..=max_tokens)
            .map(|(&n, _)| n)
            .peekable();
        for (i, &token) in prompt.iter().take(max_tokens).enumerate() {
            let Some(&next) = lengths.peek() else {
                break; // no entry is longer
            };
            hash = extend(hash, token);
            if i + 1 < next {
                continue;
            }
            lengths.next();
            if let Some(entry) = self.entries.get(&hash) {
                if entry.namespace == namespace && entry.tokens == prompt[..=i] {
                    best = Some(hash);
                }
            }
        }
        let hash = best?;
        self.touch(hash);
        let entry = &self.entries[&hash];
        Some(CachedPrefix {
            snapshot: entry.snapshot.id,
            tokens: entry.tokens.len(),
        })
    }

    /// Whether a state for exactly these tokens is cached (then there is no need to take one).
    pub fn contains(&self, key: Option<&str>, tokens: &[u32]) -> bool {
        let namespace = namespace(key);
        let hash = tokens.iter().fold(namespace, |h, &t| extend(h, t));
        self.entries
            .get(&hash)
            .is_some_and(|e| e.namespace == namespace && e.tokens == tokens)
    }

    /// Adds the state `snapshot` of the sequence `tokens`. Returns the snapshots to free: those
    /// evicted to make room, or `snapshot` itself when it is larger than the whole budget or the
    /// tokens are already cached.
    pub fn insert(
        &mut self,
        key: Option<&str>,
        tokens: Vec<u32>,
        snapshot: Snapshot,
    ) -> Vec<SnapshotId> {
        let namespace = namespace(key);
        let hash = tokens.iter().fold(namespace, |h, &t| extend(h, t));
        let entry = Entry {
            namespace,
            tokens,
            snapshot,
            last_used: 0,
        };
        if entry.bytes() > self.budget || self.entries.contains_key(&hash) {
            // (A hash collision between different prefixes keeps the older entry: rare, and
            // only a missed reuse.)
            return vec![snapshot.id];
        }
        let mut freed = Vec::new();
        while self.used + entry.bytes() > self.budget {
            let (_, oldest) = self
                .by_age
                .pop_first()
                .expect("entries hold the bytes used");
            freed.push(self.remove(oldest).snapshot.id);
        }
        self.used += entry.bytes();
        *self.lengths.entry(entry.tokens.len()).or_default() += 1;
        self.entries.insert(hash, entry);
        self.touch(hash);
        freed
    }

    /// Evicts the least recently used entry; returns its snapshot to free (None: empty).
    pub fn evict_oldest(&mut self) -> Option<SnapshotId> {
        let (_, oldest) = self.by_age.pop_first()?;
        Some(self.remove(oldest).snapshot.id)
    }

    /// Takes the entry of `hash` out of `entries`, `used` and `lengths` (its age is gone).
    fn remove(&mut self, hash: u64) -> Entry {
        let old = self.entries.remove(&hash).expect("aged entries exist");
        self.used -= old.bytes();
        let n = old.tokens.len();
        match self.lengths.get_mut(&n) {
            Some(count) if *count > 1 => *count -= 1,
            _ => {
                self.lengths.remove(&n);
            }
        }
        old
    }

    /// Empties the cache; returns every snapshot to free.
    pub fn clear(&mut self) -> Vec<SnapshotId> {
        self.by_age.clear();
        self.lengths.clear();
        self.used = 0;
        self.entries.drain().map(|(_, e)| e.snapshot.id).collect()
    }

    fn touch(&mut self, hash: u64) {
        let entry = self
            .entries
            .get_mut(&hash)
            .expect("touch an existing entry");
        self.by_age.remove(&entry.last_used);
        self.clock += 1;
        entry.last_used = self.clock;
        self.by_age.insert(self.clock, hash);
    }
}

/// The hash of the empty prefix under a `prompt_cache_key`.
fn namespace(key: Option<&str>) -> u64 {
    let mut h = DefaultHasher::new();
    key.hash(&mut h);
    h.finish()
}

/// The hash of a prefix extended by one token (splitmix64's finalizer over the pair), so every
/// prefix of a prompt is hashed in one pass.
fn extend(hash: u64, token: u32) -> u64 {
    let mut z = hash.rotate_left(29) ^ (token as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(id: SnapshotId, bytes: u64) -> Snapshot {
        Snapshot { id, bytes }
    }

    #[test]
    fn finds_the_longest_prefix_within_the_limit() {
        let mut cache = PrefixCache::new(1 << 20);
        assert!(cache.insert(None, vec![1, 2], snap(0, 10)).is_empty());
        assert!(cache.insert(None, vec![1, 2, 3, 4], snap(1, 10)).is_empty());
        assert!(cache.insert(None, vec![9, 9, 9], snap(2, 10)).is_empty());
        let hit = |c: &mut PrefixCache, p: &[u32], max| c.lookup(None, p, max);
        assert_eq!(
            hit(&mut cache, &[1, 2, 3, 4, 5], 4),
            Some(CachedPrefix {
                snapshot: 1,
                tokens: 4
            })
        );
        assert_eq!(hit(&mut cache, &[1, 2, 3, 4], 3).map(|h| h.tokens), Some(2));
        assert_eq!(hit(&mut cache, &[1, 3, 3, 4], 4), None);
        assert_eq!(hit(&mut cache, &[9, 9], 2), None);
        // A one-token prompt may reuse nothing (its token must run for the logits).
        assert!(cache.insert(None, vec![7], snap(3, 10)).is_empty());
        assert_eq!(hit(&mut cache, &[7], 0), None);
        assert_eq!(hit(&mut cache, &[7, 8], 1).map(|h| h.tokens), Some(1));
        // Another key sees nothing of these.
        assert_eq!(cache.lookup(Some("user-7"), &[1, 2, 3, 4, 5], 5), None);
        assert!(cache.contains(None, &[9, 9, 9]));
        assert!(!cache.contains(Some("user-7"), &[9, 9, 9]));
    }

    #[test]
    fn an_entry_stays_found_when_another_of_its_length_goes() {
        // Lookups probe only the lengths of the entries held: evicting one of two entries of
        // the same length must keep that length probed.
        let mut cache = PrefixCache::new(1 << 20);
        cache.insert(None, vec![1, 2, 3], snap(0, 10));
        cache.insert(None, vec![4, 5, 6], snap(1, 10));
        cache.insert(None, vec![4, 5, 6, 7, 8], snap(2, 10));
        assert_eq!(cache.evict_oldest(), Some(0));
        let tokens = |c: &mut PrefixCache, p: &[u32]| c.lookup(None, p, p.len()).map(|h| h.tokens);
        assert_eq!(tokens(&mut cache, &[4, 5, 6, 9]), Some(3));
        assert_eq!(tokens(&mut cache, &[4, 5, 6, 7, 8, 9]), Some(5));
        assert_eq!(tokens(&mut cache, &[1, 2, 3, 4]), None);
        // Both gone: no length is probed, and nothing is found.
        assert_eq!(cache.evict_oldest(), Some(1));
        assert_eq!(cache.evict_oldest(), Some(2));
        assert_eq!(tokens(&mut cache, &[4, 5, 6, 7, 8, 9]), None);
        assert!(cache.lengths.is_empty());
    }

    #[test]
    fn evicts_least_recently_used_within_the_budget() {
        // Each entry: 100 snapshot bytes + 4 bytes per token.
        let mut cache = PrefixCache::new(3 * 104);
        for id in 0..3 {
            assert!(cache
                .insert(None, vec![id as u32], snap(id, 100))
                .is_empty());
        }
        assert_eq!(cache.bytes(), 312);
        // Using entry 0 makes entry 1 the oldest.
        assert!(cache.lookup(None, &[0, 5], 1).is_some());
        assert_eq!(cache.insert(None, vec![3], snap(3, 100)), vec![1]);
        assert_eq!(cache.insert(None, vec![4], snap(4, 200)), vec![2, 0]);
        assert_eq!(cache.bytes(), 104 + 204);
        // Too big for the whole budget, or already there: handed straight back.
        assert_eq!(cache.insert(None, vec![5], snap(5, 1000)), vec![5]);
        assert_eq!(cache.insert(None, vec![3], snap(6, 1)), vec![6]);
        let mut left = cache.clear();
        left.sort();
        assert_eq!(left, vec![3, 4]);
        assert_eq!((cache.len(), cache.bytes()), (0, 0));
    }
}
