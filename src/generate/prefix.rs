//! Prompts shared between rows: rows that start with the same tokens and apply the same adapter
//! compute the keys and values of those tokens identically, so a batch computes them once per
//! distinct prefix and hands each row its copy ([`crate::model::KvCache::select_rows`]). A GRPO
//! group is the case this is for: its replies all answer one prompt on one agent's adapter.

use std::collections::HashMap;

use crate::model::ProjectionDelta;

/// How the rows of a batch share prefixes: which row stands for each distinct prefix, and
/// which distinct prefix each row has.
pub struct SharedPrefixes<'a> {
    /// The first row of each distinct (adapter, prefix), in row order.
    pub unique: Vec<usize>,
    /// Per row: the index into `unique` of its prefix.
    pub group_of_row: Vec<usize>,
    /// The adapters' deltas for the batch of `unique` rows (`None` when the batch has none).
    pub delta: Option<Box<dyn ProjectionDelta + 'a>>,
}

impl<'a> SharedPrefixes<'a> {
    /// Groups rows by (adapter, prefix). `None` when no two rows share one, when a prefix is
    /// empty, or when `delta` cannot tell its rows' adapters apart or narrow itself to a subset
    /// of rows ([`ProjectionDelta::row_key`], [`ProjectionDelta::select_rows`]): then each row
    /// computes its own prefix, as without sharing.
    pub fn find(prefixes: &[&[u32]], delta: Option<&'a dyn ProjectionDelta>) -> Option<Self> {
        if prefixes.iter().any(|p| p.is_empty()) {
            return None;
        }
        let mut unique = Vec::new();
        let mut group_of_row = Vec::with_capacity(prefixes.len());
        let mut seen: HashMap<(u64, &[u32]), usize> = HashMap::new();
        for (row, prefix) in prefixes.iter().enumerate() {
            let key = match delta {
                Some(d) => d.row_key(row)?,
                None => 0,
            };
            let group = *seen.entry((key, prefix)).or_insert_with(|| {
                unique.push(row);
                unique.len() - 1
            });
            group_of_row.push(group);
        }
        if unique.len() == prefixes.len() {
            return None;
        }
        let delta = match delta {
            Some(d) => Some(d.select_rows(&unique)?),
            None => None,
        };
        Some(Self { unique, group_of_row, delta })
    }

    /// The delta for the `unique` rows, as the forward's argument.
    pub fn unique_delta(&self) -> Option<&dyn ProjectionDelta> {
        self.delta.as_deref()
    }
}
