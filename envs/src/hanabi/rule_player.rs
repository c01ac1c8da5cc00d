//! The rule-based Hanabi baseline player ([`HanabiRulePolicy`], registered as `rule`): plays
//! cards its hints prove playable, hints a teammate's playable card, else discards.

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::cards::{Card, HandCard};
use super::moves::Move;
use super::state::HanabiState;
use super::HanabiEnv;
use crate::environment::{Action, Environment, SeatId};
use crate::error::EnvError;
use crate::policy::Policy;

/// A simple rule-based Hanabi player, in this order: play a card its hints prove playable; give a
/// hint about a teammate's playable card (the rank if the holder does not know it, else the
/// color); discard the oldest card no hint touched (the oldest card if all were); else give any
/// hint (uniformly), or play the oldest card.
#[derive(Clone, Copy, Debug, Default)]
pub struct HanabiRulePolicy;

/// Whether every card `held`'s knowledge allows would be playable now.
fn known_playable(state: &HanabiState, held: &HandCard) -> bool {
    let config = state.config();
    let k = &held.knowledge;
    (0..config.colors as u8)
        .filter(|&c| k.color_plausible(c))
        .all(|c| (0..config.ranks as u8).filter(|&r| k.rank_plausible(r)).all(|r| state.playable(Card::new(c, r))))
}

/// The rule-based choice for the current player of `state`.
pub fn rule_based_move(state: &HanabiState, rng: &mut ChaCha8Rng) -> Option<Move> {
    if state.is_terminal() {
        return None;
    }
    let config = state.config();
    let me = state.current_player();
    let hand = &state.hands()[me];
    if let Some(index) = hand.iter().position(|c| known_playable(state, c)) {
        return Some(Move::Play { index });
    }
    if state.information_tokens() > 0 {
        for offset in 1..config.players {
            let other = &state.hands()[(me + offset) % config.players];
            for held in other {
                if state.playable(held.card) && !(held.knowledge.color.is_some() && held.knowledge.rank.is_some()) {
                    return Some(if held.knowledge.rank.is_none() {
                        Move::RevealRank { offset, rank: held.card.rank }
                    } else {
                        Move::RevealColor { offset, color: held.card.color }
                    });
                }
            }
        }
    }
    let legal = state.legal_moves();
    if state.information_tokens() < config.max_information_tokens && !hand.is_empty() {
        let index = hand.iter().position(|c| c.knowledge.color.is_none() && c.knowledge.rank.is_none()).unwrap_or(0);
        return Some(Move::Discard { index });
    }
    let hints: Vec<Move> =
        legal.iter().copied().filter(|m| matches!(m, Move::RevealColor { .. } | Move::RevealRank { .. })).collect();
    if !hints.is_empty() {
        return Some(hints[rng.random_range(0..hints.len())]);
    }
    legal.first().copied()
}

impl Policy for HanabiRulePolicy {
    fn name(&self) -> &str {
        "rule"
    }

    fn act(&mut self, env: &dyn Environment, seat: SeatId, rng: &mut ChaCha8Rng) -> Result<Action, EnvError> {
        let err = |message: String| EnvError::Policy { policy: "rule".into(), env: env.name().into(), message };
        let hanabi = env
            .as_any()
            .downcast_ref::<HanabiEnv>()
            .ok_or_else(|| err("the rule-based policy plays Hanabi only".to_string()))?;
        let state = hanabi.state();
        if state.current_player() != seat {
            return Err(err(format!("seat {seat} is not to act")));
        }
        let mv = rule_based_move(state, rng).ok_or_else(|| err("the game is over".to_string()))?;
        Ok(Action::Id(mv.uid(hanabi.config())))
    }
}
