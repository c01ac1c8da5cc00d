//! Hanabi with the exact rules of DeepMind's Hanabi Learning Environment (HLE): 2 to 5 players,
//! HLE's parameters and named variants, its move uids and hand order, card knowledge from positive
//! and negative hints, the last round after the deck runs out, and score 0 once the last life is
//! lost.
//!
//! - [`params`]: parameters and variants; [`cards`]: cards and card knowledge;
//!   [`moves`]: moves and uids; [`state`]: the rules; [`observation`]: text for an LLM;
//!   [`parse`]: reading an LLM's reply as a move; [`HanabiEnv`]: the [`Environment`];
//!   [`rule_player`]: the rule-based baseline policy.

pub mod cards;
pub mod compact;
pub mod moves;
pub mod observation;
pub mod params;
pub mod parse;
pub mod rule_player;
pub mod state;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;

pub use cards::{Card, CardKnowledge, HandCard};
pub use moves::Move;
pub use params::{HanabiConfig, HanabiParams, ObservationStyle, Variant};
pub use state::{Counters, Event, HanabiState};

use crate::environment::{Action, ActionError, Environment, EpisodeMetrics, LegalAction, SeatId};
use crate::error::EnvError;
use crate::registry::parse_params;

/// Hanabi as an [`Environment`]: one seat per player, turn-based; every seat gets the score change
/// of each move as its reward, so a seat's return is the final score.
#[derive(Clone, Debug)]
pub struct HanabiEnv {
    config: HanabiConfig,
    state: HanabiState,
    returns: Vec<f64>,
    /// Subtracted from every seat's step reward per life token lost (reward shaping; 0 keeps
    /// HLE's reward).
    life_loss_penalty: f64,
    /// Added to every seat's step reward when a hint tells its receiver something new about a
    /// card that is playable now (reward shaping; 0 keeps HLE's reward).
    hint_reward: f64,
    /// The text form of observations and legal actions.
    style: ObservationStyle,
    /// Compact style only: notes on the legal actions saying which plays are known safe and
    /// which hinted cards are playable.
    playable_notes: bool,
}

impl HanabiEnv {
    /// A Hanabi environment with these rules, reset with seed 0.
    pub fn new(config: HanabiConfig) -> Self {
        let state = Self::deal(&config, 0);
        Self {
            returns: vec![0.0; config.players],
            state,
            config,
            life_loss_penalty: 0.0,
            hint_reward: 0.0,
            style: ObservationStyle::Verbose,
            playable_notes: false,
        }
    }

    /// Builds the environment from registry parameters (`{players: 3, variant: small, ...}`).
    pub fn from_params(params: &Value) -> Result<Self, EnvError> {
        let params: HanabiParams = parse_params("hanabi", params)?;
        let shaping = |field: &str, value: Option<f64>| match value.unwrap_or(0.0) {
            v if v.is_finite() && v >= 0.0 => Ok(v),
            v => Err(EnvError::BadParam {
                env: "hanabi".into(),
                field: field.into(),
                message: format!("must be a finite number >= 0, got {v}"),
            }),
        };
        let penalty = shaping("life_loss_penalty", params.life_loss_penalty)?;
        let hint_reward = shaping("hint_reward", params.hint_reward)?;
        let mut env = Self::new(params.resolve()?);
        env.life_loss_penalty = penalty;
        env.hint_reward = hint_reward;
        env.style = params.observation.unwrap_or_default();
        env.playable_notes = params.playable_notes.unwrap_or(false);
        if env.playable_notes && env.style != ObservationStyle::Compact {
            return Err(EnvError::BadParam {
                env: "hanabi".into(),
                field: "playable_notes".into(),
                message: "needs `observation: compact` (the notes are written on its legal actions)".into(),
            });
        }
        Ok(env)
    }

    fn full_deck(config: &HanabiConfig) -> Vec<Card> {
        let mut deck = Vec::with_capacity(config.deck_size());
        for color in 0..config.colors as u8 {
            for rank in 0..config.ranks as u8 {
                (0..config.copies(rank as usize)).for_each(|_| deck.push(Card::new(color, rank)));
            }
        }
        deck
    }

    fn deal(config: &HanabiConfig, seed: u64) -> HanabiState {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut deck = Self::full_deck(config);
        deck.shuffle(&mut rng);
        let start = if config.random_start_player { rng.random_range(0..config.players) } else { 0 };
        HanabiState::new(config.clone(), deck, start).expect("a shuffled full deck is a valid deck")
    }

    /// Starts a game from an explicit deck order (cards dealt front to back) and first player,
    /// as a game record gives it. Errors say what is wrong with the deck (the state is then
    /// unchanged).
    pub fn reset_with_deck(&mut self, deck: Vec<Card>, start_player: usize) -> Result<(), EnvError> {
        self.state = HanabiState::new(self.config.clone(), deck, start_player)
            .map_err(|message| EnvError::BadParam { env: "hanabi".into(), field: "deck".into(), message })?;
        self.returns = vec![0.0; self.config.players];
        Ok(())
    }

    /// The rules in force.
    pub fn config(&self) -> &HanabiConfig {
        &self.config
    }

    /// The game state (read-only), for policies and recorders that know the game.
    pub fn state(&self) -> &HanabiState {
        &self.state
    }

    /// The move an action id stands for, refusing ids out of range.
    pub fn move_of(&self, action: &Action) -> Result<Move, ActionError> {
        match action {
            Action::Id(uid) => Move::from_uid(*uid, &self.config).ok_or_else(|| ActionError::Unparseable {
                text: action.to_string(),
                reason: format!("Hanabi move uids run from 0 to {}", self.config.num_moves() - 1),
            }),
            Action::Text(text) => self.parse_move(self.state.current_player(), text),
        }
    }

    /// The text form of observations and legal actions.
    pub fn observation_style(&self) -> ObservationStyle {
        self.style
    }

    /// Reads `text` as `seat`'s move; notes in square brackets (the compact actions' `[?1]`)
    /// are ignored.
    fn parse_move(&self, seat: SeatId, text: &str) -> Result<Move, ActionError> {
        let hand_len = self.state.hands()[seat].len();
        let c = &self.config;
        parse::parse_move(&crate::text::strip_notes(text), seat, c.players, hand_len, c.colors, c.ranks)
    }

    /// The text of `mv` for the player to move, in the configured style.
    fn move_text(&self, mv: Move) -> String {
        match self.style {
            ObservationStyle::Verbose => mv.text(self.state.current_player(), self.config.players),
            ObservationStyle::Compact => compact::action_text(&self.state, mv, self.playable_notes),
        }
    }

    /// Applies a move of the current player and draws its replacement card; returns the score
    /// change. Illegal moves are refused with the reason and change nothing.
    pub fn apply(&mut self, mv: Move) -> Result<i32, ActionError> {
        let reward = self.apply_without_draw(mv)?;
        self.state.draw();
        Ok(reward)
    }

    /// Applies a move of the current player but leaves its replacement card undrawn, as HLE's
    /// chance node does; [`HanabiEnv::draw`] deals it. For replaying records step by step.
    pub fn apply_without_draw(&mut self, mv: Move) -> Result<i32, ActionError> {
        let reward = self.state.apply_move(mv)?;
        for r in &mut self.returns {
            *r += reward as f64;
        }
        Ok(reward)
    }

    /// Deals the card owed by the last play or discard, if any; returns it.
    pub fn draw(&mut self) -> Option<Card> {
        self.state.draw()
    }

    /// Whether `mv` is a hint that tells its receiver something new (a color or rank that was
    /// still open) about a card of theirs that is playable now: what `hint_reward` pays for.
    fn tells_of_a_playable_card(&self, mv: Move) -> bool {
        let offset = match mv {
            Move::RevealColor { offset, .. } | Move::RevealRank { offset, .. } => offset,
            Move::Play { .. } | Move::Discard { .. } => return false,
        };
        let tells = |held: &HandCard| match mv {
            Move::RevealColor { color, .. } => {
                held.card.color == color && held.knowledge.plausible_colors != 1 << color
            }
            Move::RevealRank { rank, .. } => held.card.rank == rank && held.knowledge.plausible_ranks != 1 << rank,
            Move::Play { .. } | Move::Discard { .. } => false,
        };
        let target = (self.state.current_player() + offset) % self.config.players;
        self.state.hands()[target].iter().any(|held| tells(held) && self.state.playable(held.card))
    }

    fn legal_texts(&self, seat: SeatId) -> Vec<String> {
        if seat != self.state.current_player() || self.state.is_terminal() {
            return Vec::new();
        }
        self.state.legal_moves().into_iter().map(|m| self.move_text(m)).collect()
    }
}

impl Environment for HanabiEnv {
    fn name(&self) -> &str {
        "hanabi"
    }

    fn num_seats(&self) -> usize {
        self.config.players
    }

    fn reset(&mut self, seed: u64) {
        self.state = Self::deal(&self.config, seed);
        self.returns = vec![0.0; self.config.players];
    }

    fn acting_seats(&self) -> Vec<SeatId> {
        if self.state.is_terminal() {
            Vec::new()
        } else {
            vec![self.state.current_player()]
        }
    }

    fn instructions(&self, seat: SeatId) -> String {
        match self.style {
            ObservationStyle::Verbose => observation::instructions_text(&self.state, seat),
            ObservationStyle::Compact => compact::instructions(&self.state, seat),
        }
    }

    fn observation(&self, seat: SeatId) -> String {
        if seat >= self.config.players {
            return format!("There is no seat {seat}: this game has {} players.", self.config.players);
        }
        match self.style {
            ObservationStyle::Verbose => {
                observation::observation_text(&self.state, seat, &self.legal_texts(seat), self.config.history_moves)
            }
            ObservationStyle::Compact => compact::observation(&self.state, seat, self.config.history_moves),
        }
    }

    fn legal_actions(&self, seat: SeatId) -> Option<Vec<LegalAction>> {
        if seat != self.state.current_player() || self.state.is_terminal() {
            return Some(Vec::new());
        }
        let mut out = Vec::new();
        self.state
            .for_each_legal_move(|mv| out.push(LegalAction { id: mv.uid(&self.config), text: self.move_text(mv) }));
        Some(out)
    }

    fn legal_action_ids(&self, seat: SeatId) -> Option<Vec<u32>> {
        if seat != self.state.current_player() || self.state.is_terminal() {
            return Some(Vec::new());
        }
        let mut out = Vec::with_capacity(self.config.num_moves());
        self.state.for_each_legal_move(|mv| out.push(mv.uid(&self.config)));
        Some(out)
    }

    fn parse_action(&self, seat: SeatId, text: &str) -> Result<Action, ActionError> {
        if self.state.is_terminal() {
            return Err(ActionError::EpisodeOver);
        }
        if seat != self.state.current_player() {
            return Err(ActionError::NotToAct { seat });
        }
        let mv = self.parse_move(seat, text)?;
        if let Some(reason) = self.state.illegal_reason(mv) {
            return Err(ActionError::Illegal { action: mv.text(seat, self.config.players), reason });
        }
        Ok(Action::Id(mv.uid(&self.config)))
    }

    fn step(&mut self, actions: &[Action]) -> Result<Vec<f64>, ActionError> {
        if self.state.is_terminal() {
            return Err(ActionError::EpisodeOver);
        }
        let [action] = actions else {
            return Err(ActionError::WrongActionCount { expected: 1, got: actions.len() });
        };
        let mv = self.move_of(action)?;
        let lives = self.state.life_tokens();
        let useful_hint = self.hint_reward > 0.0 && self.tells_of_a_playable_card(mv);
        let mut reward = self.apply(mv)? as f64;
        let lost = lives.saturating_sub(self.state.life_tokens());
        let mut shaping = 0.0;
        if lost > 0 {
            shaping -= self.life_loss_penalty * f64::from(lost);
        }
        if useful_hint {
            shaping += self.hint_reward;
        }
        if shaping != 0.0 {
            reward += shaping;
            for r in &mut self.returns {
                *r += shaping;
            }
        }
        Ok(vec![reward; self.config.players])
    }

    fn is_terminal(&self) -> bool {
        self.state.is_terminal()
    }

    fn returns(&self) -> Vec<f64> {
        self.returns.clone()
    }

    fn metrics(&self) -> EpisodeMetrics {
        let s = &self.state;
        let mut m = EpisodeMetrics::new();
        m.insert("score".into(), s.score() as f64);
        m.insert("fireworks".into(), s.fireworks_total() as f64);
        m.insert("lives_lost".into(), (self.config.max_life_tokens - s.life_tokens()) as f64);
        m.insert("information_tokens".into(), s.information_tokens() as f64);
        m.insert("moves".into(), s.player_moves() as f64);
        m.insert("deck_exhausted".into(), if s.deck_size() == 0 { 1.0 } else { 0.0 });
        m.insert("perfect".into(), if s.score() == self.config.max_score() { 1.0 } else { 0.0 });
        // What the players did: plays that scored, misplays, discards and hints.
        let (mut plays, mut misplays, mut discards, mut hints) = (0.0, 0.0, 0.0, 0.0);
        for event in s.events() {
            match event {
                Event::Move { mv: Move::Play { .. }, scored: true, .. } => plays += 1.0,
                Event::Move { mv: Move::Play { .. }, .. } => misplays += 1.0,
                Event::Move { mv: Move::Discard { .. }, .. } => discards += 1.0,
                Event::Move { .. } => hints += 1.0,
                Event::Deal { .. } => {}
            }
        }
        m.insert("plays".into(), plays);
        m.insert("misplays".into(), misplays);
        m.insert("discards".into(), discards);
        m.insert("hints".into(), hints);
        m
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
