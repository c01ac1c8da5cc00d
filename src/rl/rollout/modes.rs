//! Which [`Decider`] plays each [`ActionMode`]: the one place that knows every mode's file.

use super::action::{ActionMode, Decider};
use super::choice::Choice;
use super::constrained::Constrained;
use super::free::Free;

impl ActionMode {
    /// The mode's decider, chosen once per rollout.
    pub fn decider(self) -> &'static dyn Decider {
        match self {
            ActionMode::Free => &Free,
            ActionMode::Constrained => &Constrained,
            ActionMode::Choice => &Choice,
        }
    }
}
