//! The wire types of the external-environment protocol (envs/README.md, "Environments in any
//! language"): what one line of JSON holds, and the checks a State must pass before troupe
//! trusts it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::environment::{Action, EpisodeMetrics, LegalAction, SeatId};

/// The protocol version troupe speaks (`init.protocol`).
pub const PROTOCOL_VERSION: u32 = 1;

/// An action on the wire: `{"id": n}` or `{"text": "..."}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum WireAction {
    /// One of the legal actions, by id.
    Id {
        /// The action id.
        id: u32,
    },
    /// An open-ended text reply.
    Text {
        /// The reply.
        text: String,
    },
}

impl From<&Action> for WireAction {
    fn from(action: &Action) -> Self {
        match action {
            Action::Id(id) => WireAction::Id { id: *id },
            Action::Text(text) => WireAction::Text { text: text.clone() },
        }
    }
}

impl From<WireAction> for Action {
    fn from(action: WireAction) -> Self {
        match action {
            WireAction::Id { id } => Action::Id(id),
            WireAction::Text { text } => Action::Text(text),
        }
    }
}

/// Everything troupe asks an environment between two steps, for every seat.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WireState {
    /// The seats that must act now, in the order `step` takes their actions.
    pub acting_seats: Vec<SeatId>,
    /// Whether the episode is over.
    pub terminal: bool,
    /// Per seat: the standing instructions.
    pub instructions: Vec<String>,
    /// Per seat: what it may know now.
    pub observations: Vec<String>,
    /// Per seat: its legal actions in ascending id order, or `None` for open-ended text.
    pub legal_actions: Vec<Option<Vec<LegalAction>>>,
    /// Per seat: the sum of its step rewards so far.
    pub returns: Vec<f64>,
    /// The episode's named numbers (at least `score`).
    pub metrics: EpisodeMetrics,
}

impl WireState {
    /// Checks the state against `num_seats`: one entry per seat everywhere, acting seats in
    /// range and distinct, none once terminal, legal actions in ascending id order, finite
    /// numbers. The error names the field.
    pub fn check(&self, num_seats: usize) -> Result<(), String> {
        let per_seat = [
            ("instructions", self.instructions.len()),
            ("observations", self.observations.len()),
            ("legal_actions", self.legal_actions.len()),
            ("returns", self.returns.len()),
        ];
        for (field, len) in per_seat {
            if len != num_seats {
                return Err(format!("`{field}` has {len} entries for {num_seats} seats"));
            }
        }
        let mut seen = vec![false; num_seats];
        for &seat in &self.acting_seats {
            if seat >= num_seats || std::mem::replace(&mut seen[seat], true) {
                return Err(format!("`acting_seats` {:?}: seat {seat} is out of range or repeated", self.acting_seats));
            }
        }
        if self.terminal && !self.acting_seats.is_empty() {
            return Err("a terminal state has `acting_seats`".to_string());
        }
        if !self.terminal && self.acting_seats.is_empty() {
            return Err("a state that is not terminal has no `acting_seats`".to_string());
        }
        for (seat, legal) in self.legal_actions.iter().enumerate() {
            if let Some(legal) = legal {
                if legal.windows(2).any(|w| w[0].id >= w[1].id) {
                    return Err(format!("`legal_actions[{seat}]` is not in ascending id order"));
                }
            }
        }
        for &seat in &self.acting_seats {
            if matches!(&self.legal_actions[seat], Some(legal) if legal.is_empty()) {
                return Err(format!("acting seat {seat} has no legal action"));
            }
        }
        if let Some(r) = self.returns.iter().find(|r| !r.is_finite()) {
            return Err(format!("`returns` holds {r}"));
        }
        if !self.metrics.contains_key("score") {
            return Err("`metrics` has no `score`".to_string());
        }
        if let Some((key, value)) = self.metrics.iter().find(|(_, v)| !v.is_finite()) {
            return Err(format!("metric `{key}` is {value}"));
        }
        Ok(())
    }
}

/// One entry of a `step` result: the seats' rewards and the new state, or why the step was
/// refused.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(untagged)]
pub enum WireStepResult {
    /// The step was applied.
    Stepped {
        /// Per seat: the reward of this step.
        rewards: Vec<f64>,
        /// The state after the step.
        state: WireState,
    },
    /// The step was refused; the episode is unchanged.
    Refused {
        /// Why.
        error: String,
    },
}

/// One entry of a `parse` result.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(untagged)]
pub enum WireParseResult {
    /// The text reads as this action.
    Parsed {
        /// The action.
        action: WireAction,
    },
    /// The text is not an action of the seat.
    Refused {
        /// Why.
        error: String,
    },
}

/// The result of `init`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WireHello {
    /// The environment's name.
    pub name: String,
    /// Its number of seats.
    pub num_seats: usize,
}

/// The result of `reset`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WireStates {
    /// One state per episode asked for, in order.
    pub states: Vec<WireState>,
}

/// The result of `step` or `parse`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WireResults<T> {
    /// One entry per request entry, in order.
    pub results: Vec<T>,
}

/// A state of no seats, before the first reset (or after a failure).
pub(crate) fn empty_state(num_seats: usize) -> WireState {
    WireState {
        acting_seats: Vec::new(),
        terminal: true,
        instructions: vec![String::new(); num_seats],
        observations: vec![String::new(); num_seats],
        legal_actions: vec![Some(Vec::new()); num_seats],
        returns: vec![0.0; num_seats],
        metrics: BTreeMap::from([("score".to_string(), 0.0)]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> WireState {
        WireState {
            acting_seats: vec![0],
            terminal: false,
            instructions: vec!["a".into(), "b".into()],
            observations: vec!["x".into(), "y".into()],
            legal_actions: vec![
                Some(vec![LegalAction { id: 0, text: "bet".into() }, LegalAction { id: 1, text: "pass".into() }]),
                Some(vec![]),
            ],
            returns: vec![0.0, 0.0],
            metrics: BTreeMap::from([("score".to_string(), 0.0)]),
        }
    }

    #[test]
    fn a_well_formed_state_passes_and_each_defect_is_named() {
        assert_eq!(state().check(2), Ok(()));
        assert!(state().check(3).unwrap_err().contains("`instructions` has 2 entries for 3 seats"));
        let mut s = state();
        s.acting_seats = vec![0, 0];
        assert!(s.check(2).unwrap_err().contains("repeated"));
        let mut s = state();
        s.terminal = true;
        assert!(s.check(2).unwrap_err().contains("terminal"));
        let mut s = state();
        s.legal_actions[0].as_mut().unwrap().reverse();
        assert!(s.check(2).unwrap_err().contains("ascending"));
        let mut s = state();
        s.metrics.clear();
        assert!(s.check(2).unwrap_err().contains("score"));
        let mut s = state();
        s.returns[1] = f64::NAN;
        assert!(s.check(2).unwrap_err().contains("returns"));
    }

    #[test]
    fn actions_round_trip_through_their_wire_form() {
        for action in [Action::Id(7), Action::Text("hello".into())] {
            let wire = serde_json::to_string(&WireAction::from(&action)).unwrap();
            let back: WireAction = serde_json::from_str(&wire).unwrap();
            assert_eq!(Action::from(back), action);
        }
        assert_eq!(serde_json::to_string(&WireAction::Id { id: 3 }).unwrap(), r#"{"id":3}"#);
    }
}
