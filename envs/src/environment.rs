//! The `Environment` plug-in trait: one interface for turn-based games (one seat acts at a time)
//! and simultaneous tasks (every seat acts, one joint reward), with the types it speaks in
//! (seats, actions, metrics) and [`ActionError`], its refusal of an action.
//!
//! An episode is driven like this:
//!
//! ```text
//! env.reset(seed);
//! while !env.is_terminal() {
//!     let seats = env.acting_seats();                 // who must act now
//!     let actions = seats.iter().map(|&s| {            // one agent reply per seat
//!         let prompt = env.observation(s);
//!         env.parse_action(s, &reply_text)            // text -> Action (typed error if not legal)
//!     });
//!     let step_rewards = env.step(&actions)?;          // actions[i] belongs to seats[i]
//! }
//! let returns = env.returns();                         // per seat, summed over the episode
//! ```

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Index of a seat (a player position) in an environment, `0..num_seats()`.
pub type SeatId = usize;

/// An action taken by one seat.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Action {
    /// One of a finite set of moves, by id: HLE's move uid for Hanabi, OpenSpiel's action id for
    /// Bridge.
    Id(u32),
    /// Open-ended text (writing, coding): the agent's completion itself is the action.
    Text(String),
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Id(id) => write!(f, "action {id}"),
            Action::Text(text) => write!(f, "{text:?}"),
        }
    }
}

/// One legal move of a finite action set, with its canonical text form (what an agent should
/// write to choose it, and what `choice`/`constrained` action modes score or decode).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LegalAction {
    /// The action id (as in [`Action::Id`]).
    pub id: u32,
    /// The canonical text, e.g. `play card 2`, `hint player 1 red`, `1NT`, `SA`.
    pub text: String,
}

/// Named numbers an environment reports about a finished (or running) episode, e.g.
/// `score`, `lives_lost`, `contract_made`. Keys are stable across episodes of one environment.
pub type EpisodeMetrics = BTreeMap<String, f64>;

/// Why a text or an action was refused. Returned by `parse_action` and `step`; the environment's
/// state is unchanged whenever one is returned.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ActionError {
    /// The text names no action of this environment.
    #[error("cannot read {text:?} as an action: {reason}")]
    Unparseable {
        /// The text the agent wrote (possibly shortened).
        text: String,
        /// What was expected.
        reason: String,
    },
    /// The action exists but the rules forbid it now.
    #[error("illegal action {action}: {reason}")]
    Illegal {
        /// The action in its canonical text form.
        action: String,
        /// Which rule forbids it.
        reason: String,
    },
    /// A seat tried to act out of turn.
    #[error("seat {seat} is not to act now")]
    NotToAct {
        /// The seat.
        seat: SeatId,
    },
    /// `step` got a different number of actions than there are acting seats.
    #[error("expected {expected} action(s), one per acting seat, got {got}")]
    WrongActionCount {
        /// Number of acting seats.
        expected: usize,
        /// Number of actions given.
        got: usize,
    },
    /// The episode is over.
    #[error("the episode is over")]
    EpisodeOver,
    /// The environment itself failed (an external process crashed, hung or broke the protocol):
    /// not the agent's fault, and no episode can go on.
    #[error("{0}")]
    Failed(String),
}

/// The plug-in interface every troupe environment implements.
///
/// Implementations are deterministic given the seed passed to [`Environment::reset`]: the same
/// seed and the same actions give the same episode. An illegal or malformed action never changes
/// the state: [`Environment::step`] returns the error and leaves everything as it was.
pub trait Environment: Send + 'static {
    /// The registry name of this environment (`hanabi`, `bridge`, `writing`, ...).
    fn name(&self) -> &str;

    /// Number of seats (player positions); seat ids are `0..num_seats()`.
    fn num_seats(&self) -> usize;

    /// Starts a new episode, dealing or sampling everything from `seed` (with `rand_chacha`).
    fn reset(&mut self, seed: u64);

    /// The seats that must act now, in the order [`Environment::step`] expects their actions:
    /// one seat in a turn-based game, every seat in a simultaneous task, none once terminal.
    fn acting_seats(&self) -> Vec<SeatId>;

    /// Standing instructions for `seat`: the rules and the answer format, suitable for a system
    /// message. Changes at most between episodes, never within one.
    fn instructions(&self, seat: SeatId) -> String;

    /// What `seat` may know right now, as text for an LLM prompt (never hidden information).
    fn observation(&self, seat: SeatId) -> String;

    /// The legal actions of `seat` when the set is finite (games), in ascending id order; `None`
    /// for open-ended text actions (writing, coding) and an empty list when `seat` need not act.
    fn legal_actions(&self, seat: SeatId) -> Option<Vec<LegalAction>>;

    /// The ids of [`Environment::legal_actions`], without building their texts: what a policy
    /// that does not read text (random play, a tree search) needs. Games override it for speed.
    fn legal_action_ids(&self, seat: SeatId) -> Option<Vec<u32>> {
        self.legal_actions(seat).map(|legal| legal.into_iter().map(|a| a.id).collect())
    }

    /// Reads an agent's reply as an action of `seat`. Tolerant of case, spacing, surrounding
    /// words and a tagged final answer (`<answer>...</answer>`); an error says why the text is
    /// not a legal action.
    fn parse_action(&self, seat: SeatId, text: &str) -> Result<Action, ActionError>;

    /// Applies one joint action: `actions[i]` is the action of `acting_seats()[i]`. Returns the
    /// reward each seat got from this step (`num_seats()` entries). On error the state is unchanged.
    fn step(&mut self, actions: &[Action]) -> Result<Vec<f64>, ActionError>;

    /// Whether the episode is over.
    fn is_terminal(&self) -> bool;

    /// Each seat's return so far: the sum of its step rewards (`num_seats()` entries).
    fn returns(&self) -> Vec<f64>;

    /// The episode's metrics (at least `score`, the headline number an evaluation reports).
    /// Training and evaluation average each metric over the episodes that report it, so a
    /// metric that only some episodes have is not diluted by zeros.
    fn metrics(&self) -> EpisodeMetrics;

    /// The concrete environment, for code that knows its type (a rule-based Hanabi policy
    /// reading card knowledge, a game recorder). Implement as `{ self }`.
    fn as_any(&self) -> &dyn std::any::Any;
}
