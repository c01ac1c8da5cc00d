//! Which items of a dataset an environment draws from: all of them, the training part, or the
//! held-out part (every third item: items 2, 5, 8, ...), so that a run trains on some prompts
//! and evaluates on others (`env: {split: train}` with `eval: {env: {split: test}}`).

use serde::{Deserialize, Serialize};

/// A part of a dataset.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// Every item.
    #[default]
    All,
    /// The items not held out.
    Train,
    /// The held-out items: every third one (0-based index % 3 == 2).
    Test,
}

impl Split {
    /// Whether the item at `index` belongs to this split.
    pub fn contains(self, index: usize) -> bool {
        match self {
            Split::All => true,
            Split::Train => index % 3 != 2,
            Split::Test => index % 3 == 2,
        }
    }

    /// The items of `items` in this split, in order.
    pub fn select<T>(self, items: Vec<T>) -> Vec<T> {
        items.into_iter().enumerate().filter(|(i, _)| self.contains(*i)).map(|(_, item)| item).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn train_and_test_partition_the_items() {
        let items: Vec<usize> = (0..10).collect();
        assert_eq!(Split::Test.select(items.clone()), vec![2, 5, 8]);
        assert_eq!(Split::Train.select(items.clone()), vec![0, 1, 3, 4, 6, 7, 9]);
        assert_eq!(Split::All.select(items.clone()), items);
    }
}
