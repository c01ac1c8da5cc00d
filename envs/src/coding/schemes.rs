//! Cooperation schemes: how the main function uses the helper, found by parsing the code
//! with Python's own `ast` module by the judge inside the sandbox (see `judge.py`), never by matching
//! text.
//!
//! - **fallback**: a helper call inside a `try` (its body, handlers or `else`);
//! - **decorator**: the helper's result used by further logic in straight-line code (not a
//!   bare `return aux(...)` wrapper, not in a loop, condition or `try`);
//! - **coordinator**: the helper called in a loop (`for`/`while` body, a comprehension, or
//!   passed to `map`/`sorted`/`min`/... or as a `key=`);
//! - **strategy filter**: the helper called inside a condition (`if`/`while` test, a
//!   conditional expression, a comprehension's `if`, or passed to `filter`).
//!
//! A helper that is defined but never used, or whose name main rebinds (a parameter, a local
//! `def`, an assignment), counts as not called.

use serde::{Deserialize, Serialize};

use crate::environment::EpisodeMetrics;

/// Per-scheme counts of helper uses in main.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchemeCounts {
    /// Uses inside `try`.
    pub fallback: u32,
    /// Results used by further straight-line logic.
    pub decorator: u32,
    /// Uses in a loop.
    pub coordinator: u32,
    /// Uses in a condition.
    pub strategy_filter: u32,
}

/// What parsing the program says about main and helper.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Analysis {
    /// The program defines the entry point at top level.
    pub defines_entry: bool,
    /// The program defines the helper at top level.
    pub defines_helper: bool,
    /// Main really uses the helper (calls it, or passes it on), with its name not rebound.
    pub helper_called: bool,
    /// Main rebinds the helper's name (so its uses are not the helper agent's function).
    pub helper_shadowed: bool,
    /// Main is nothing but `return helper(...)`.
    pub wrapper: bool,
    /// Main calls the helper and throws the result away.
    pub ignored_result: bool,
    /// Uses per scheme.
    pub schemes: SchemeCounts,
}

/// The four schemes, by name.
pub const SCHEMES: [&str; 4] = ["fallback", "decorator", "coordinator", "strategy_filter"];

impl Analysis {
    /// The schemes present (count > 0), by name.
    pub fn schemes_present(&self) -> Vec<&'static str> {
        let counts = self.schemes;
        [counts.fallback, counts.decorator, counts.coordinator, counts.strategy_filter]
            .iter()
            .zip(SCHEMES)
            .filter(|(count, _)| **count > 0)
            .map(|(_, name)| name)
            .collect()
    }

    /// Adds `scheme_<name>` (1 when present, else 0), `helper_called` and `helper_wrapper` to
    /// episode metrics, so that summing them over an iteration's episodes counts schemes.
    pub fn add_metrics(&self, metrics: &mut EpisodeMetrics) {
        let present = self.schemes_present();
        for name in SCHEMES {
            metrics.insert(format!("scheme_{name}"), f64::from(u8::from(present.contains(&name))));
        }
        metrics.insert("helper_called".to_string(), f64::from(u8::from(self.helper_called)));
        metrics.insert("helper_wrapper".to_string(), f64::from(u8::from(self.wrapper)));
    }
}
