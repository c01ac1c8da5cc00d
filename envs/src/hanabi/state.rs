//! Hanabi's state and rules, exactly as HLE applies them: move legality, playing, discarding,
//! hints with positive and negative knowledge, drawing, the last round once the deck runs out, and
//! the score (0 once the last life token is lost).

use super::cards::{Card, CardKnowledge, HandCard, COLOR_NAMES};
use super::moves::Move;
use super::params::HanabiConfig;
use crate::environment::ActionError;

/// Counters right after a player's move, before the replacement card is drawn (as the game
/// records hold them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counters {
    /// Life tokens left.
    pub life: u32,
    /// Information tokens available.
    pub info: u32,
    /// Fireworks height per color.
    pub fireworks: Vec<u8>,
    /// Cards left in the deck.
    pub deck: usize,
}

/// What happened in one step of the game.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A card was dealt to `player` (appended at the end of the hand).
    Deal {
        /// Who got the card.
        player: usize,
        /// The card.
        card: Card,
    },
    /// A player moved.
    Move {
        /// Who moved.
        player: usize,
        /// The move.
        mv: Move,
        /// The card played or discarded (`None` for hints).
        card: Option<Card>,
        /// For a play: whether it was added to the fireworks.
        scored: bool,
        /// For a hint: the absolute slots (0-based) of the target's hand it touched.
        touched: Vec<usize>,
        /// Score change (losing the last life drops the score to 0).
        reward: i32,
        /// The counters right after the move, before any draw.
        after: Counters,
    },
}

/// A Hanabi game in progress.
#[derive(Clone, Debug)]
pub struct HanabiState {
    config: HanabiConfig,
    deck: Vec<Card>,
    next_card: usize,
    hands: Vec<Vec<HandCard>>,
    fireworks: Vec<u8>,
    info: u32,
    life: u32,
    discards: Vec<Card>,
    turns_to_play: usize,
    current: usize,
    pending_draw: Option<usize>,
    player_moves: usize,
    events: Vec<Event>,
}

impl HanabiState {
    /// A game whose deck is `deck` (cards drawn front to back) with `start_player` first to move.
    /// Deals the opening hands: player 0's whole hand, then player 1's, and so on.
    ///
    /// Errors name the card when `deck` does not hold exactly the cards of a full deck.
    pub fn new(config: HanabiConfig, deck: Vec<Card>, start_player: usize) -> Result<Self, String> {
        let mut counts = vec![0usize; config.colors * config.ranks];
        for card in &deck {
            if card.color as usize >= config.colors || card.rank as usize >= config.ranks {
                return Err(format!(
                    "card {card} is not in a deck of {} colors and {} ranks",
                    config.colors, config.ranks
                ));
            }
            counts[card.index(config.ranks) as usize] += 1;
        }
        for (index, &count) in counts.iter().enumerate() {
            let card = Card::from_index(index as u32, config.ranks);
            if count != config.copies(card.rank as usize) {
                return Err(format!(
                    "the deck holds {count} of {card}, expected {}",
                    config.copies(card.rank as usize)
                ));
            }
        }
        if start_player >= config.players {
            return Err(format!("start player {start_player} is not one of {} players", config.players));
        }
        let mut state = Self {
            fireworks: vec![0; config.colors],
            info: config.max_information_tokens,
            life: config.max_life_tokens,
            hands: vec![Vec::with_capacity(config.hand_size); config.players],
            turns_to_play: config.players,
            current: start_player,
            deck,
            next_card: 0,
            discards: Vec::new(),
            pending_draw: None,
            player_moves: 0,
            events: Vec::with_capacity(128),
            config,
        };
        for player in 0..state.config.players {
            for _ in 0..state.config.hand_size {
                state.deal_to(player);
            }
        }
        Ok(state)
    }

    /// The rules in force.
    pub fn config(&self) -> &HanabiConfig {
        &self.config
    }

    /// The player to move.
    pub fn current_player(&self) -> usize {
        self.current
    }

    /// Every hand, oldest card first.
    pub fn hands(&self) -> &[Vec<HandCard>] {
        &self.hands
    }

    /// Fireworks height per color.
    pub fn fireworks(&self) -> &[u8] {
        &self.fireworks
    }

    /// Information tokens available.
    pub fn information_tokens(&self) -> u32 {
        self.info
    }

    /// Life tokens left.
    pub fn life_tokens(&self) -> u32 {
        self.life
    }

    /// Cards left in the deck.
    pub fn deck_size(&self) -> usize {
        self.deck.len() - self.next_card
    }

    /// The discard pile (including misplayed cards), oldest first.
    pub fn discards(&self) -> &[Card] {
        &self.discards
    }

    /// Every deal and move so far.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// Player moves made so far.
    pub fn player_moves(&self) -> usize {
        self.player_moves
    }

    /// Turns left once the deck is empty (HLE's `turns_to_play`; equals the player count
    /// before that).
    pub fn turns_to_play(&self) -> usize {
        self.turns_to_play
    }

    /// The score: the fireworks' total, or 0 once the last life token is lost.
    pub fn score(&self) -> u32 {
        if self.life == 0 {
            0
        } else {
            self.fireworks.iter().map(|&f| f as u32).sum()
        }
    }

    /// Sum of the fireworks regardless of lives.
    pub fn fireworks_total(&self) -> u32 {
        self.fireworks.iter().map(|&f| f as u32).sum()
    }

    /// Whether the game is over: no life left, all fireworks complete, or the last round played.
    pub fn is_terminal(&self) -> bool {
        self.life == 0 || self.fireworks_total() >= self.config.max_score() || self.turns_to_play == 0
    }

    /// Whether the current player's move is waiting for its replacement card.
    pub fn draw_pending(&self) -> bool {
        self.pending_draw.is_some()
    }

    fn deal_to(&mut self, player: usize) -> Option<Card> {
        let card = *self.deck.get(self.next_card)?;
        self.next_card += 1;
        let knowledge = CardKnowledge::new(self.config.colors, self.config.ranks);
        self.hands[player].push(HandCard { card, knowledge });
        self.events.push(Event::Deal { player, card });
        Some(card)
    }

    /// Whether a card of `color` at 0-based `rank` would be added to the fireworks now.
    pub fn playable(&self, card: Card) -> bool {
        self.fireworks[card.color as usize] == card.rank
    }

    /// Why `mv` is illegal for the current player now, or `None` when it is legal.
    pub fn illegal_reason(&self, mv: Move) -> Option<String> {
        if self.is_terminal() {
            return Some("the game is over".to_string());
        }
        let hand_len = self.hands[self.current].len();
        let players = self.config.players;
        match mv {
            Move::Discard { index } | Move::Play { index } => {
                if index >= hand_len {
                    return Some(format!("you hold {hand_len} cards, there is no card {}", index + 1));
                }
                if matches!(mv, Move::Discard { .. }) && self.info >= self.config.max_information_tokens {
                    return Some(format!(
                        "cannot discard while all {} information tokens are available",
                        self.config.max_information_tokens
                    ));
                }
                None
            }
            Move::RevealColor { offset, color } => self.hint_problem(offset).or_else(|| {
                let target = (self.current + offset) % players;
                if color as usize >= self.config.colors {
                    Some(format!("this game has only {} colors", self.config.colors))
                } else if !self.hands[target].iter().any(|c| c.card.color == color) {
                    Some(format!("player {target} holds no {} card", COLOR_NAMES[color as usize]))
                } else {
                    None
                }
            }),
            Move::RevealRank { offset, rank } => self.hint_problem(offset).or_else(|| {
                let target = (self.current + offset) % players;
                if rank as usize >= self.config.ranks {
                    Some(format!("this game has only ranks 1 to {}", self.config.ranks))
                } else if !self.hands[target].iter().any(|c| c.card.rank == rank) {
                    Some(format!("player {target} holds no card of rank {}", rank + 1))
                } else {
                    None
                }
            }),
        }
    }

    /// Why no hint to the player at `offset` can be given now, if so.
    fn hint_problem(&self, offset: usize) -> Option<String> {
        if offset < 1 || offset >= self.config.players {
            Some("you cannot give a hint to yourself".to_string())
        } else if self.info == 0 {
            Some("no information tokens are left to give a hint".to_string())
        } else {
            None
        }
    }

    /// The current player's legal moves in uid order (empty once the game is over).
    pub fn legal_moves(&self) -> Vec<Move> {
        let mut out = Vec::with_capacity(self.config.num_moves());
        self.for_each_legal_move(|mv| out.push(mv));
        out
    }

    /// Calls `f` with each legal move of the current player, in uid order, without allocating.
    pub fn for_each_legal_move(&self, mut f: impl FnMut(Move)) {
        if self.is_terminal() {
            return;
        }
        let hand_len = self.hands[self.current].len();
        if self.info < self.config.max_information_tokens {
            (0..hand_len).for_each(|index| f(Move::Discard { index }));
        }
        (0..hand_len).for_each(|index| f(Move::Play { index }));
        if self.info == 0 {
            return;
        }
        let players = self.config.players;
        for offset in 1..players {
            let hand = &self.hands[(self.current + offset) % players];
            let colors = hand.iter().fold(0u8, |m, c| m | 1 << c.card.color);
            (0..self.config.colors as u8)
                .filter(|c| colors & 1 << c != 0)
                .for_each(|color| f(Move::RevealColor { offset, color }));
        }
        for offset in 1..players {
            let hand = &self.hands[(self.current + offset) % players];
            let ranks = hand.iter().fold(0u8, |m, c| m | 1 << c.card.rank);
            (0..self.config.ranks as u8)
                .filter(|r| ranks & 1 << r != 0)
                .for_each(|rank| f(Move::RevealRank { offset, rank }));
        }
    }

    fn counters(&self) -> Counters {
        Counters { life: self.life, info: self.info, fireworks: self.fireworks.clone(), deck: self.deck_size() }
    }

    /// Applies the current player's move without drawing the replacement card (call
    /// [`HanabiState::draw`] next, as HLE's chance player would). Returns the score change.
    /// An illegal move is refused with its reason and changes nothing.
    pub fn apply_move(&mut self, mv: Move) -> Result<i32, ActionError> {
        if let Some(reason) = self.illegal_reason(mv) {
            return Err(ActionError::Illegal { action: mv.text(self.current, self.config.players), reason });
        }
        let score_before = self.score() as i32;
        if self.deck_size() == 0 {
            self.turns_to_play -= 1;
        }
        let player = self.current;
        let mut card = None;
        let mut scored = false;
        let mut touched = Vec::new();
        match mv {
            Move::Discard { index } => {
                let removed = self.hands[player].remove(index).card;
                self.discards.push(removed);
                self.info += 1;
                card = Some(removed);
                self.pending_draw = Some(player);
            }
            Move::Play { index } => {
                let removed = self.hands[player].remove(index).card;
                card = Some(removed);
                if self.playable(removed) {
                    scored = true;
                    self.fireworks[removed.color as usize] += 1;
                    if self.fireworks[removed.color as usize] as usize == self.config.ranks
                        && self.info < self.config.max_information_tokens
                    {
                        self.info += 1;
                    }
                } else {
                    self.life -= 1;
                    self.discards.push(removed);
                }
                self.pending_draw = Some(player);
            }
            Move::RevealColor { offset, color } => {
                self.info -= 1;
                let target = (player + offset) % self.config.players;
                for (slot, held) in self.hands[target].iter_mut().enumerate() {
                    if held.card.color == color {
                        held.knowledge.apply_color(color);
                        touched.push(slot);
                    } else {
                        held.knowledge.apply_not_color(color);
                    }
                }
            }
            Move::RevealRank { offset, rank } => {
                self.info -= 1;
                let target = (player + offset) % self.config.players;
                for (slot, held) in self.hands[target].iter_mut().enumerate() {
                    if held.card.rank == rank {
                        held.knowledge.apply_rank(rank);
                        touched.push(slot);
                    } else {
                        held.knowledge.apply_not_rank(rank);
                    }
                }
            }
        }
        if self.deck_size() == 0 {
            self.pending_draw = None;
        }
        self.player_moves += 1;
        let reward = self.score() as i32 - score_before;
        let after = self.counters();
        self.events.push(Event::Move { player, mv, card, scored, touched, reward, after });
        self.current = (player + 1) % self.config.players;
        Ok(reward)
    }

    /// Draws the replacement card owed by the last play or discard, if any; returns it.
    pub fn draw(&mut self) -> Option<Card> {
        let player = self.pending_draw.take()?;
        self.deal_to(player)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hanabi::params::{HanabiParams, Variant};

    fn config(players: usize) -> HanabiConfig {
        HanabiParams { players: Some(players), ..Default::default() }.resolve().expect("valid")
    }

    /// A full deck in index order: R1 R1 R1 R2 R2 ... B5.
    fn sorted_deck(config: &HanabiConfig) -> Vec<Card> {
        let mut deck = Vec::new();
        for color in 0..config.colors as u8 {
            for rank in 0..config.ranks as u8 {
                for _ in 0..config.copies(rank as usize) {
                    deck.push(Card::new(color, rank));
                }
            }
        }
        deck
    }

    fn step(state: &mut HanabiState, mv: Move) -> i32 {
        let reward = state.apply_move(mv).expect("legal move");
        state.draw();
        reward
    }

    #[test]
    fn deals_player_zero_first_and_counts_cards() {
        let config = config(2);
        let state = HanabiState::new(config.clone(), sorted_deck(&config), 0).expect("valid deck");
        let p0: Vec<String> = state.hands()[0].iter().map(|c| c.card.to_string()).collect();
        assert_eq!(p0, ["R1", "R1", "R1", "R2", "R2"]);
        assert_eq!(state.deck_size(), 40);
        assert_eq!(state.events().len(), 10);
    }

    #[test]
    fn rejects_a_wrong_deck() {
        let config = config(2);
        let mut deck = sorted_deck(&config);
        deck.pop();
        assert!(HanabiState::new(config, deck, 0).unwrap_err().contains("B5"));
    }

    #[test]
    fn discard_refused_with_full_tokens_and_state_unchanged() {
        let config = config(2);
        let mut state = HanabiState::new(config.clone(), sorted_deck(&config), 0).expect("valid deck");
        let err = state.apply_move(Move::Discard { index: 0 }).unwrap_err();
        assert!(err.to_string().contains("information tokens"), "{err}");
        assert_eq!(state.deck_size(), 40);
        assert_eq!(state.current_player(), 0);
        assert_eq!(state.legal_moves().iter().filter(|m| matches!(m, Move::Discard { .. })).count(), 0);
    }

    #[test]
    fn play_scores_misplay_costs_a_life_and_refills_hand_at_the_end() {
        let config = config(2);
        let mut state = HanabiState::new(config.clone(), sorted_deck(&config), 0).expect("valid deck");
        assert_eq!(step(&mut state, Move::Play { index: 0 }), 1); // R1
        assert_eq!(state.fireworks()[0], 1);
        // The drawn card (next in the deck: Y2? deck index 10 = Y1) is appended at the end.
        assert_eq!(state.hands()[0].len(), 5);
        assert_eq!(state.hands()[0][4].card, Card::new(1, 0));
        // Player 1 holds R3 R3 R4 R4 R5: playing R3 now is a misplay.
        assert_eq!(step(&mut state, Move::Play { index: 0 }), 0);
        assert_eq!(state.life_tokens(), 2);
        assert_eq!(state.discards(), &[Card::new(0, 2)]);
    }

    #[test]
    fn hints_cost_a_token_and_set_positive_and_negative_knowledge() {
        let config = config(2);
        let mut state = HanabiState::new(config.clone(), sorted_deck(&config), 0).expect("valid deck");
        // Player 1 holds R3 R3 R4 R4 R5.
        let err = state.apply_move(Move::RevealColor { offset: 1, color: 1 }).unwrap_err();
        assert!(err.to_string().contains("holds no yellow card"), "{err}");
        step(&mut state, Move::RevealRank { offset: 1, rank: 3 });
        assert_eq!(state.information_tokens(), 7);
        let knowledge: Vec<String> = state.hands()[1].iter().map(|c| c.knowledge.hle_string(5, 5)).collect();
        assert_eq!(knowledge, ["XX|RYGWB1235", "XX|RYGWB1235", "X4|RYGWB4", "X4|RYGWB4", "XX|RYGWB1235"]);
        match state.events().last() {
            Some(Event::Move { touched, .. }) => assert_eq!(touched, &vec![2, 3]),
            other => panic!("expected a move event, got {other:?}"),
        }
    }

    #[test]
    fn no_hints_without_tokens() {
        let config = HanabiParams { max_information_tokens: Some(1), ..Default::default() }.resolve().expect("valid");
        let mut state = HanabiState::new(config.clone(), sorted_deck(&config), 0).expect("valid deck");
        step(&mut state, Move::RevealRank { offset: 1, rank: 2 });
        let err = state.apply_move(Move::RevealRank { offset: 1, rank: 0 }).unwrap_err();
        assert!(err.to_string().contains("no information tokens"), "{err}");
    }

    #[test]
    fn completing_a_color_returns_a_token_and_losing_last_life_scores_zero() {
        let config = HanabiParams { variant: Variant::VerySmall, ..Default::default() }.resolve().expect("valid");
        // Very small: one color, hands of 2, 3 info tokens, 1 life. Deck R1 R2 R3 R4 R5 R1 R1 R2 R3 R4.
        let r = |rank| Card::new(0, rank);
        let deck = vec![r(0), r(1), r(2), r(3), r(4), r(0), r(0), r(1), r(2), r(3)];
        let mut state = HanabiState::new(config, deck, 0).expect("valid deck");
        step(&mut state, Move::Play { index: 0 }); // p0 plays R1, draws R5
        step(&mut state, Move::RevealRank { offset: 1, rank: 1 }); // p1 hints, info 2
        assert_eq!(state.information_tokens(), 2);
        assert_eq!(step(&mut state, Move::Play { index: 0 }), 1); // p0 plays R2
                                                                  // p1 holds R3 R4; p1 plays R3, then p0 (R5 R1) misplays R1: last life lost.
        step(&mut state, Move::Play { index: 0 });
        assert_eq!(state.score(), 3);
        assert_eq!(step(&mut state, Move::Play { index: 1 }), -3);
        assert_eq!(state.score(), 0);
        assert!(state.is_terminal());
        assert!(state.legal_moves().is_empty());
        assert_eq!(
            state.apply_move(Move::Play { index: 0 }).unwrap_err().to_string(),
            "illegal action play card 1: the game is over"
        );
    }

    #[test]
    fn completing_a_color_with_all_tokens_gives_none_and_ends_a_one_color_game() {
        let r = |rank| Card::new(0, rank);
        let config = HanabiParams {
            variant: Variant::VerySmall,
            players: Some(2),
            max_information_tokens: Some(1),
            ..Default::default()
        }
        .resolve()
        .expect("valid");
        let deck = vec![r(0), r(1), r(2), r(3), r(4), r(0), r(0), r(1), r(2), r(3)];
        let mut state = HanabiState::new(config, deck, 0).expect("valid deck");
        // p0: R1 R2, p1: R3 R4. Play 1, 3, 2, 4 in turn... each play draws the next card.
        step(&mut state, Move::Play { index: 0 }); // p0 R1 -> hand R2 R5
        step(&mut state, Move::RevealRank { offset: 1, rank: 1 }); // p1 spends the only token
        assert_eq!(state.information_tokens(), 0);
        step(&mut state, Move::Play { index: 0 }); // p0 R2 -> hand R5 R1
        step(&mut state, Move::Play { index: 0 }); // p1 R3 -> hand R4 R1
        step(&mut state, Move::Discard { index: 1 }); // p0 discards R1: 1 token
        step(&mut state, Move::Play { index: 0 }); // p1 R4
        assert_eq!(state.information_tokens(), 1);
        step(&mut state, Move::Play { index: 0 }); // p0 R5 completes red with tokens full
        assert_eq!(state.fireworks()[0], 5);
        assert_eq!(state.information_tokens(), 1, "never above the maximum");
        assert!(state.is_terminal(), "all fireworks complete");
        assert_eq!(state.score(), 5);
    }

    #[test]
    fn completing_a_color_below_the_maximum_returns_a_token() {
        let config = HanabiParams {
            variant: Variant::VerySmall,
            players: Some(2),
            max_information_tokens: Some(2),
            ..Default::default()
        }
        .resolve()
        .expect("valid");
        let r = |rank| Card::new(0, rank);
        let deck = vec![r(0), r(1), r(2), r(3), r(4), r(0), r(0), r(1), r(2), r(3)];
        let mut state = HanabiState::new(config, deck, 0).expect("valid deck");
        step(&mut state, Move::Play { index: 0 }); // p0 R1 -> R2 R5
        step(&mut state, Move::RevealRank { offset: 1, rank: 1 }); // 1 token
        step(&mut state, Move::Play { index: 0 }); // p0 R2 -> R5 R1
        step(&mut state, Move::Play { index: 0 }); // p1 R3 -> R4 R1
        step(&mut state, Move::RevealRank { offset: 1, rank: 3 }); // p0 hints: 0 tokens
        step(&mut state, Move::Play { index: 0 }); // p1 R4
        assert_eq!(state.information_tokens(), 0);
        step(&mut state, Move::Play { index: 0 }); // p0 R5
        assert_eq!(state.information_tokens(), 1, "completing red returned a token");
    }

    #[test]
    fn playing_a_card_beyond_the_hand_is_refused() {
        let config = config(2);
        let mut state = HanabiState::new(config.clone(), sorted_deck(&config), 0).expect("valid deck");
        let err = state.apply_move(Move::Play { index: 5 }).unwrap_err();
        assert_eq!(err.to_string(), "illegal action play card 6: you hold 5 cards, there is no card 6");
        let err = state.apply_move(Move::RevealColor { offset: 1, color: 7 }).unwrap_err();
        assert!(err.to_string().contains("only 5 colors"), "{err}");
        assert_eq!(state.player_moves(), 0);
    }

    #[test]
    fn last_round_after_the_deck_runs_out() {
        let config = HanabiParams { variant: Variant::VerySmall, max_life_tokens: Some(3), ..Default::default() }
            .resolve()
            .expect("valid");
        let r = |rank| Card::new(0, rank);
        let deck = vec![r(4), r(4 - 1), r(0), r(1), r(0), r(0), r(1), r(2), r(2), r(3)];
        let mut state = HanabiState::new(config, deck, 0).expect("valid deck");
        // 6 cards left; spend them with hints and discards: each discard draws one card.
        step(&mut state, Move::RevealRank { offset: 1, rank: 0 });
        while state.deck_size() > 0 {
            let mv = state.legal_moves().into_iter().find(|m| matches!(m, Move::Discard { .. })).expect("can discard");
            step(&mut state, mv);
            if state.deck_size() > 0 && state.information_tokens() == 3 {
                let rank = state.hands()[(state.current_player() + 1) % 2][0].card.rank;
                step(&mut state, Move::RevealRank { offset: 1, rank });
            }
        }
        assert_eq!(state.turns_to_play(), 2);
        assert!(!state.is_terminal());
        let mv = state.legal_moves()[0];
        step(&mut state, mv);
        assert!(!state.is_terminal());
        assert_eq!(state.hands().iter().map(Vec::len).min(), Some(1), "no card to draw any more");
        let mv = state.legal_moves()[0];
        step(&mut state, mv);
        assert!(state.is_terminal());
    }
}
