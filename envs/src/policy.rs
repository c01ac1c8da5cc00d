//! The baseline-policy seam, so trained agents have something to be measured against: the
//! [`Policy`] trait and uniformly random legal moves for any game. Policies that know one game
//! live beside it (`hanabi::rule_player`, `coding::CanonicalPolicy`) and are registered with the
//! built-ins in the crate root.

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::environment::{Action, Environment, SeatId};
use crate::error::EnvError;

/// Chooses an action for a seat. Policies see the environment through the same trait as any
/// other caller (and may downcast with [`Environment::as_any`] to read a game they know).
pub trait Policy: Send {
    /// The policy's name (`random`, `rule`, ...).
    fn name(&self) -> &str;

    /// The action of `seat` now. `rng` is the policy's own seeded randomness.
    fn act(&mut self, env: &dyn Environment, seat: SeatId, rng: &mut ChaCha8Rng) -> Result<Action, EnvError>;
}

/// Picks uniformly among the legal actions. In open-ended text environments (no finite action
/// set) it answers with an empty reply, the floor any agent should beat.
#[derive(Clone, Copy, Debug, Default)]
pub struct RandomPolicy;

impl Policy for RandomPolicy {
    fn name(&self) -> &str {
        "random"
    }

    fn act(&mut self, env: &dyn Environment, seat: SeatId, rng: &mut ChaCha8Rng) -> Result<Action, EnvError> {
        match env.legal_action_ids(seat) {
            None => Ok(Action::Text(String::new())),
            Some(legal) if legal.is_empty() => Err(EnvError::Policy {
                policy: "random".into(),
                env: env.name().into(),
                message: format!("seat {seat} has no legal action"),
            }),
            Some(legal) => Ok(Action::Id(legal[rng.random_range(0..legal.len())])),
        }
    }
}
