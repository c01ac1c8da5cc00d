//! Hanabi's parameters: HLE's knobs with HLE's defaults, and its named variants.

use serde::{Deserialize, Serialize};

use crate::error::EnvError;

/// The most colors HLE supports (R Y G W B).
pub const MAX_COLORS: usize = 5;
/// The most ranks HLE supports (1 to 5).
pub const MAX_RANKS: usize = 5;

/// A named parameter set from HLE's `rl_env` (`Hanabi-Full`, `Hanabi-Small`, `Hanabi-Very-Small`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Variant {
    /// 5 colors, 5 ranks, HLE's hand size, 8 information and 3 life tokens.
    #[default]
    #[serde(alias = "Hanabi-Full", alias = "hanabi-full", alias = "Hanabi-Full-Minimal")]
    Full,
    /// 2 colors, 5 ranks, hands of 2, 3 information tokens, 1 life token.
    #[serde(alias = "Hanabi-Small", alias = "hanabi-small")]
    Small,
    /// 1 color, 5 ranks, hands of 2, 3 information tokens, 1 life token.
    #[serde(alias = "Hanabi-Very-Small", alias = "hanabi-very-small", alias = "very-small")]
    VerySmall,
}

/// Hanabi parameters as a config writes them (`env: {name: hanabi, players: 3}`). Unset knobs
/// take the variant's value, and the variant defaults to `full`, which is HLE's default game.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HanabiParams {
    /// Named preset the other knobs start from.
    pub variant: Variant,
    /// Number of players, 2 to 5 (default 2).
    pub players: Option<usize>,
    /// Number of colors, 1 to 5.
    pub colors: Option<usize>,
    /// Number of ranks, 1 to 5.
    pub ranks: Option<usize>,
    /// Cards per hand (HLE: 5 for 2-3 players, 4 for 4-5).
    pub hand_size: Option<usize>,
    /// Information tokens at the start and at most (default 8).
    pub max_information_tokens: Option<u32>,
    /// Life tokens at the start (default 3).
    pub max_life_tokens: Option<u32>,
    /// Whether the first player is drawn at random (default false: player 0 starts).
    pub random_start_player: Option<bool>,
    /// How many of the latest moves the text observation lists (default: two full rounds).
    pub history_moves: Option<usize>,
    /// Reward shaping for learners: subtracted from every seat's step reward when a move loses
    /// a life token (default 0, HLE's reward: the score change only). The `score` metric is
    /// unaffected.
    pub life_loss_penalty: Option<f64>,
    /// Reward shaping for learners: added to every seat's step reward when a hint tells its
    /// receiver something new (a color or rank not yet ruled in or out) about a card that is
    /// playable now (default 0, HLE's reward). At most once per hint; the `score` metric is
    /// unaffected.
    pub hint_reward: Option<f64>,
    /// The text agents see: `verbose` (default; full sentences and the rules, for
    /// instruction-tuned LLMs) or `compact` (the same information in far fewer tokens, with
    /// each legal action annotated; for small models). See [`super::compact`].
    pub observation: Option<ObservationStyle>,
    /// With the `compact` observation: notes on the legal actions that say which plays the actor
    /// knows to be safe (`play 1 [?1 playable]`) and which hinted cards are playable now
    /// (`hint 1 [R1 playable]`), deductions a person makes at a glance (default false).
    pub playable_notes: Option<bool>,
}

/// How a Hanabi observation is written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ObservationStyle {
    /// Full sentences and the rules ([`super::observation`]).
    #[default]
    Verbose,
    /// The same information in far fewer tokens ([`super::compact`]).
    Compact,
}

/// Validated Hanabi rules: every knob resolved to a number.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HanabiConfig {
    /// Number of players.
    pub players: usize,
    /// Number of colors.
    pub colors: usize,
    /// Number of ranks.
    pub ranks: usize,
    /// Cards per hand.
    pub hand_size: usize,
    /// Information tokens at the start and at most.
    pub max_information_tokens: u32,
    /// Life tokens at the start.
    pub max_life_tokens: u32,
    /// Whether the first player is drawn at random.
    pub random_start_player: bool,
    /// How many of the latest moves the text observation lists.
    pub history_moves: usize,
}

fn bad(field: &str, message: String) -> EnvError {
    EnvError::BadParam { env: "hanabi".to_string(), field: field.to_string(), message }
}

impl HanabiParams {
    /// Resolves the variant and defaults and checks every range, naming the offending field.
    pub fn resolve(&self) -> Result<HanabiConfig, EnvError> {
        let (colors, ranks, hand, info, life) = match self.variant {
            Variant::Full => (5, 5, None, 8, 3),
            Variant::Small => (2, 5, Some(2), 3, 1),
            Variant::VerySmall => (1, 5, Some(2), 3, 1),
        };
        let players = self.players.unwrap_or(2);
        if !(2..=5).contains(&players) {
            return Err(bad("players", format!("{players} is out of range 2..=5")));
        }
        let colors = self.colors.unwrap_or(colors);
        if !(1..=MAX_COLORS).contains(&colors) {
            return Err(bad("colors", format!("{colors} is out of range 1..={MAX_COLORS}")));
        }
        let ranks = self.ranks.unwrap_or(ranks);
        if !(1..=MAX_RANKS).contains(&ranks) {
            return Err(bad("ranks", format!("{ranks} is out of range 1..={MAX_RANKS}")));
        }
        let default_hand = hand.unwrap_or(if players < 4 { 5 } else { 4 });
        let hand_size = self.hand_size.unwrap_or(default_hand);
        if hand_size == 0 || hand_size > 8 {
            return Err(bad("hand_size", format!("{hand_size} is out of range 1..=8")));
        }
        let config = HanabiConfig {
            players,
            colors,
            ranks,
            hand_size,
            max_information_tokens: self.max_information_tokens.unwrap_or(info),
            max_life_tokens: self.max_life_tokens.unwrap_or(life),
            random_start_player: self.random_start_player.unwrap_or(false),
            history_moves: self.history_moves.unwrap_or(2 * players),
        };
        if config.max_life_tokens == 0 {
            return Err(bad("max_life_tokens", "must be at least 1".to_string()));
        }
        if hand_size * players > config.deck_size() {
            return Err(bad(
                "hand_size",
                format!("{players} hands of {hand_size} need more than the {} cards of the deck", config.deck_size()),
            ));
        }
        Ok(config)
    }
}

impl HanabiConfig {
    /// Copies of the card (color, 0-based rank) in the deck, as HLE counts them: three of the
    /// lowest rank, one of the highest, two of the others.
    pub fn copies(&self, rank: usize) -> usize {
        if rank == 0 {
            3
        } else if rank + 1 == self.ranks {
            1
        } else {
            2
        }
    }

    /// Cards in a full deck.
    pub fn deck_size(&self) -> usize {
        self.colors * (0..self.ranks).map(|r| self.copies(r)).sum::<usize>()
    }

    /// The highest possible score.
    pub fn max_score(&self) -> u32 {
        (self.colors * self.ranks) as u32
    }

    /// Number of move uids (HLE's `MaxMoves`).
    pub fn num_moves(&self) -> usize {
        2 * self.hand_size + (self.players - 1) * (self.colors + self.ranks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_hle_defaults() {
        let c = HanabiParams::default().resolve().expect("defaults are valid");
        assert_eq!((c.players, c.colors, c.ranks, c.hand_size), (2, 5, 5, 5));
        assert_eq!((c.max_information_tokens, c.max_life_tokens), (8, 3));
        assert_eq!(c.deck_size(), 50);
        assert_eq!(c.num_moves(), 20);
        let four = HanabiParams { players: Some(4), ..Default::default() }.resolve().expect("valid");
        assert_eq!(four.hand_size, 4);
    }

    #[test]
    fn variants() {
        let small = HanabiParams { variant: Variant::Small, players: Some(3), ..Default::default() };
        let c = small.resolve().expect("valid");
        assert_eq!((c.colors, c.ranks, c.hand_size, c.max_information_tokens, c.max_life_tokens), (2, 5, 2, 3, 1));
        let very = HanabiParams { variant: Variant::VerySmall, ..Default::default() }.resolve().expect("valid");
        assert_eq!((very.colors, very.deck_size()), (1, 10));
    }

    #[test]
    fn hle_variant_names_are_accepted() {
        for (name, variant) in [
            ("Hanabi-Full", Variant::Full),
            ("Hanabi-Small", Variant::Small),
            ("Hanabi-Very-Small", Variant::VerySmall),
        ] {
            let params: HanabiParams =
                serde_json::from_value(serde_json::json!({"variant": name})).expect("known name");
            assert_eq!(params.variant, variant);
        }
    }

    #[test]
    fn out_of_range_names_the_field() {
        let err = HanabiParams { players: Some(6), ..Default::default() }.resolve().unwrap_err();
        assert!(err.to_string().contains("players"), "{err}");
        let err =
            HanabiParams { variant: Variant::VerySmall, players: Some(5), hand_size: Some(3), ..Default::default() }
                .resolve()
                .unwrap_err();
        assert!(err.to_string().contains("hand_size"), "{err}");
    }
}
