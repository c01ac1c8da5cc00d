//! Contract bridge with the rules of OpenSpiel's `bridge`: four seats (N E S W), a dealt board
//! (dealer and vulnerability from the board number as in duplicate play, or set explicitly), the
//! auction and the play with full legality, dummy played by the declarer's seat, duplicate
//! scoring, PBN deals, and a bidding-only mode scored from supplied double-dummy tricks.
//!
//! - [`cards`]: cards, seats, deals and PBN; [`auction`]: calls and contracts; [`play`]: tricks;
//!   [`scoring`]: duplicate scores; [`observation`]: text for an LLM; [`parse`]: reading replies;
//!   [`BridgeEnv`]: the [`Environment`].
//!
//! Seats map to agents freely: give each seat its own agent, or one agent per partnership (seats
//! 0 and 2 share N/S's return, 1 and 3 E/W's).

pub mod auction;
pub mod cards;
pub mod observation;
pub mod parse;
pub mod play;
pub mod scoring;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use auction::{Auction, Call};
pub use cards::{Card, Deal};
pub use play::{Play, Trick};
pub use scoring::{score, Contract};

use crate::environment::{Action, ActionError, Environment, EpisodeMetrics, LegalAction, SeatId};
use crate::error::EnvError;
use crate::registry::parse_params;
use cards::{partnership, SEAT_CHARS, SEAT_NAMES};

/// Tricks the declarer takes with best play, by denomination (C D H S NT) and declarer seat
/// (N E S W): OpenSpiel's double-dummy table layout.
pub type DdTable = [[u8; 4]; 5];

/// A seat written as a number (0..4) or a name (`N`, `north`, ...).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SeatSpec {
    /// 0..4 = N E S W.
    Index(usize),
    /// `N`, `E`, `S`, `W` or the full name, any case.
    Name(String),
}

impl SeatSpec {
    fn resolve(&self) -> Result<usize, String> {
        match self {
            SeatSpec::Index(i) if *i < 4 => Ok(*i),
            SeatSpec::Index(i) => Err(format!("{i} is not a seat (0..4 = N E S W)")),
            SeatSpec::Name(name) => {
                let lower = name.trim().to_ascii_lowercase();
                (0..4)
                    .find(|&s| {
                        lower == SEAT_NAMES[s].to_ascii_lowercase()
                            || lower == SEAT_CHARS[s].to_ascii_lowercase().to_string()
                    })
                    .ok_or_else(|| format!("{name:?} is not a seat (N, E, S, W)"))
            }
        }
    }
}

/// Bridge parameters as a config writes them. By default North deals, nobody is vulnerable and
/// each episode deals fresh cards from its seed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BridgeParams {
    /// The dealer (default North), unless `board` or `rotate_boards` sets it.
    pub dealer: Option<SeatSpec>,
    /// `none`, `ns`, `ew` or `both` (default `none`).
    pub vulnerability: Option<String>,
    /// OpenSpiel's knob: whether the dealer's side is vulnerable.
    pub dealer_vul: Option<bool>,
    /// OpenSpiel's knob: whether the other side is vulnerable.
    pub non_dealer_vul: Option<bool>,
    /// A duplicate board number (1, 2, ...): sets the dealer and vulnerability as printed on
    /// board `board` of a standard set.
    pub board: Option<u32>,
    /// Cycle through boards 1 to 16 by episode seed (`seed % 16 + 1`).
    pub rotate_boards: bool,
    /// A fixed deal in PBN, played every episode.
    pub deal: Option<String>,
    /// Play the auction only and score from double-dummy tricks (`dd_table` or `deals_file`).
    pub bidding_only: bool,
    /// With `deal`: the double-dummy tricks, 5 rows (C D H S NT) of 4 (declarer N E S W).
    pub dd_table: Option<Vec<Vec<u32>>>,
    /// A JSONL file of boards, one `{"pbn": ..., "dd_table": [[...]]}` per line; each episode
    /// draws one by its seed.
    pub deals_file: Option<String>,
}

/// How each episode's dealer and vulnerability are chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
enum BoardRule {
    Fixed { dealer: usize, vulnerable: [bool; 2] },
    Numbered(u32),
    Rotating,
}

/// A board to play: a deal and, for bidding-only play, its double-dummy tricks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BoardDeal {
    /// The cards.
    pub deal: Deal,
    /// Double-dummy tricks, when known.
    pub dd: Option<DdTable>,
}

/// The dealer and vulnerability (N/S, E/W) of duplicate board `board` (1-based; repeats every 16).
pub fn board_conditions(board: u32) -> (usize, [bool; 2]) {
    let b = (board.max(1) - 1) % 16;
    // None, NS, EW, Both laid out as on a standard set of 16 boards.
    const VUL: [u8; 16] = [0, 1, 2, 3, 1, 2, 3, 0, 2, 3, 0, 1, 3, 0, 1, 2];
    let v = VUL[b as usize];
    ((b % 4) as usize, [v == 1 || v == 3, v == 2 || v == 3])
}

fn bad(field: &str, message: impl Into<String>) -> EnvError {
    EnvError::BadParam { env: "bridge".into(), field: field.into(), message: message.into() }
}

fn dd_table_of(rows: &[Vec<u32>], field: &str) -> Result<DdTable, EnvError> {
    let mut table = [[0u8; 4]; 5];
    if rows.len() != 5 || rows.iter().any(|r| r.len() != 4) {
        return Err(bad(field, "needs 5 rows (C D H S NT) of 4 trick counts (declarer N E S W)"));
    }
    for (d, row) in rows.iter().enumerate() {
        for (s, &t) in row.iter().enumerate() {
            if t > 13 {
                return Err(bad(field, format!("row {d}, column {s}: {t} tricks is more than 13")));
            }
            table[d][s] = t as u8;
        }
    }
    Ok(table)
}

/// Validated bridge settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BridgeSettings {
    board: BoardRule,
    boards: Vec<BoardDeal>,
    bidding_only: bool,
}

impl BridgeParams {
    /// Checks the parameters (and reads `deals_file`), naming the offending field.
    pub fn resolve(&self) -> Result<BridgeSettings, EnvError> {
        let explicit = self.dealer.is_some()
            || self.vulnerability.is_some()
            || self.dealer_vul.is_some()
            || self.non_dealer_vul.is_some();
        if (self.board.is_some() || self.rotate_boards) && explicit {
            return Err(bad(
                "board",
                "`board`/`rotate_boards` set the dealer and vulnerability; do not also give them",
            ));
        }
        if self.board.is_some() && self.rotate_boards {
            return Err(bad("board", "give either `board` or `rotate_boards`, not both"));
        }
        if self.vulnerability.is_some() && (self.dealer_vul.is_some() || self.non_dealer_vul.is_some()) {
            return Err(bad("vulnerability", "give either `vulnerability` or `dealer_vul`/`non_dealer_vul`"));
        }
        let board = if let Some(b) = self.board {
            if b == 0 {
                return Err(bad("board", "board numbers start at 1"));
            }
            BoardRule::Numbered(b)
        } else if self.rotate_boards {
            BoardRule::Rotating
        } else {
            let dealer = self.dealer.as_ref().map_or(Ok(0), SeatSpec::resolve).map_err(|m| bad("dealer", m))?;
            let vulnerable = match self.vulnerability.as_deref().map(|v| v.trim().to_ascii_lowercase()) {
                None => {
                    let (d, n) = (self.dealer_vul.unwrap_or(false), self.non_dealer_vul.unwrap_or(false));
                    if partnership(dealer) == 0 {
                        [d, n]
                    } else {
                        [n, d]
                    }
                }
                Some(v) => match v.as_str() {
                    "none" | "-" => [false, false],
                    "ns" | "n/s" | "n-s" => [true, false],
                    "ew" | "e/w" | "e-w" => [false, true],
                    "both" | "all" => [true, true],
                    other => return Err(bad("vulnerability", format!("{other:?} is not one of none, ns, ew, both"))),
                },
            };
            BoardRule::Fixed { dealer, vulnerable }
        };
        let mut boards = Vec::new();
        if let Some(pbn) = &self.deal {
            let deal = Deal::from_pbn(pbn).map_err(|m| bad("deal", m))?;
            let dd = self.dd_table.as_deref().map(|t| dd_table_of(t, "dd_table")).transpose()?;
            boards.push(BoardDeal { deal, dd });
        } else if self.dd_table.is_some() {
            return Err(bad("dd_table", "a double-dummy table belongs to one deal: give `deal` too"));
        }
        if let Some(path) = &self.deals_file {
            if !boards.is_empty() {
                return Err(bad("deals_file", "give either `deal` or `deals_file`, not both"));
            }
            boards = read_deals_file(path)?;
        }
        if self.bidding_only && (boards.is_empty() || boards.iter().any(|b| b.dd.is_none())) {
            return Err(bad("bidding_only", "needs double-dummy tricks: `deal` with `dd_table`, or a `deals_file`"));
        }
        Ok(BridgeSettings { board, boards, bidding_only: self.bidding_only })
    }
}

/// Reads a JSONL file of boards: `{"pbn": "N:...", "dd_table": [[...] x5]}` per line.
pub fn read_deals_file(path: &str) -> Result<Vec<BoardDeal>, EnvError> {
    let data = |message: String| EnvError::Data { path: path.to_string(), message };
    let text = std::fs::read_to_string(path).map_err(|e| data(e.to_string()))?;
    let mut boards = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let at = |m: String| data(format!("line {}: {m}", n + 1));
        let value: Value = serde_json::from_str(line).map_err(|e| at(e.to_string()))?;
        let pbn = value.get("pbn").and_then(Value::as_str).ok_or_else(|| at("missing string field `pbn`".into()))?;
        let deal = Deal::from_pbn(pbn).map_err(|m| at(format!("pbn: {m}")))?;
        let dd = match value.get("dd_table") {
            None | Some(Value::Null) => None,
            Some(t) => {
                let rows: Vec<Vec<u32>> =
                    serde_json::from_value(t.clone()).map_err(|e| at(format!("dd_table: {e}")))?;
                Some(dd_table_of(&rows, "dd_table").map_err(|e| at(e.to_string()))?)
            }
        };
        boards.push(BoardDeal { deal, dd });
    }
    if boards.is_empty() {
        return Err(data("holds no boards".into()));
    }
    Ok(boards)
}

/// Where a board stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Calls are being made.
    Auction,
    /// Cards are being played.
    Play,
    /// The board is scored.
    Over,
}

/// Bridge as an [`Environment`]: four seats, turn-based; the duplicate score goes to both
/// members of each side at the end of the board (N/S's score to seats 0 and 2, its negation to
/// 1 and 3). On dummy's turns the declarer's seat acts.
#[derive(Clone, Debug)]
pub struct BridgeEnv {
    settings: BridgeSettings,
    deal: Deal,
    dd: Option<DdTable>,
    dealer: usize,
    vulnerable: [bool; 2],
    auction: Auction,
    play: Option<Play>,
    phase: Phase,
    returns: [f64; 4],
}

impl BridgeEnv {
    /// A bridge environment with these settings, reset with seed 0.
    pub fn new(settings: BridgeSettings) -> Self {
        let deal = Deal::from_order(&(0..52).collect::<Vec<_>>()).expect("0..52 is a valid deal");
        let mut env = Self {
            settings,
            deal,
            dd: None,
            dealer: 0,
            vulnerable: [false; 2],
            auction: Auction::new(0),
            play: None,
            phase: Phase::Auction,
            returns: [0.0; 4],
        };
        env.reset(0);
        env
    }

    /// Builds the environment from registry parameters.
    pub fn from_params(params: &Value) -> Result<Self, EnvError> {
        let params: BridgeParams = parse_params("bridge", params)?;
        Ok(Self::new(params.resolve()?))
    }

    /// Starts a board with this deal, dealer and vulnerability (N/S, E/W), and for
    /// bidding-only play its double-dummy tricks.
    pub fn reset_with_deal(&mut self, deal: Deal, dealer: usize, vulnerable: [bool; 2], dd: Option<DdTable>) {
        self.deal = deal;
        self.dd = dd;
        self.dealer = dealer % 4;
        self.vulnerable = vulnerable;
        self.auction = Auction::new(self.dealer);
        self.play = None;
        self.phase = Phase::Auction;
        self.returns = [0.0; 4];
    }

    /// The deal being played.
    pub fn deal(&self) -> &Deal {
        &self.deal
    }

    /// The auction so far.
    pub fn auction(&self) -> &Auction {
        &self.auction
    }

    /// The play, once the auction has produced a contract (and not in bidding-only mode).
    pub fn play(&self) -> Option<&Play> {
        self.play.as_ref()
    }

    /// The phase of the board.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Vulnerability of N/S and E/W.
    pub fn vulnerability(&self) -> [bool; 2] {
        self.vulnerable
    }

    /// Whether the auction only is played.
    pub fn bidding_only(&self) -> bool {
        self.settings.bidding_only
    }

    /// The final contract once the auction is over.
    pub fn contract(&self) -> Option<Contract> {
        self.auction.is_over().then(|| self.auction.contract())
    }

    /// The cards each seat still holds (bitmasks over card ids).
    pub fn current_hands(&self) -> [u64; 4] {
        self.play.as_ref().map_or_else(|| self.deal.hands(), |p| *p.hands())
    }

    /// The seat whose call or card comes next (dummy's seat on dummy's turns).
    pub fn seat_to_move(&self) -> usize {
        match (&self.phase, &self.play) {
            (Phase::Play, Some(play)) => play.to_play(),
            _ => self.auction.to_call(),
        }
    }

    /// The seat that must act: [`BridgeEnv::seat_to_move`], except the declarer for dummy.
    pub fn acting_seat(&self) -> usize {
        let seat = self.seat_to_move();
        match self.contract() {
            Some(c) if self.phase == Phase::Play && seat == (c.declarer + 2) % 4 => c.declarer,
            _ => seat,
        }
    }

    /// Tricks the declarer took (play finished, or double-dummy in bidding-only mode).
    pub fn declarer_tricks(&self) -> Option<u32> {
        let contract = self.contract().filter(|c| c.level > 0)?;
        match (&self.play, self.dd) {
            (Some(play), _) => Some(play.declarer_tricks()),
            (None, Some(dd)) if self.phase == Phase::Over => {
                Some(dd[contract.denomination as usize][contract.declarer] as u32)
            }
            _ => None,
        }
    }

    /// The final duplicate score of N/S and of E/W (zero until the board is over).
    pub fn returns_ns_ew(&self) -> [f64; 2] {
        [self.returns[0], self.returns[1]]
    }

    /// The legal action ids of the acting seat, ascending.
    pub fn legal_ids(&self) -> Vec<u32> {
        match self.phase {
            Phase::Over => Vec::new(),
            Phase::Auction => self.auction.legal_calls().into_iter().map(Call::id).collect(),
            Phase::Play => {
                let mask = self.play.as_ref().map_or(0, Play::legal_mask);
                (0..52).filter(|c| mask & (1 << c) != 0).collect()
            }
        }
    }

    /// OpenSpiel's string for action `id` (`HT`, `Pass`, `1NT`).
    pub fn action_text(id: u32) -> String {
        if id < 52 {
            Card(id as u8).to_string()
        } else {
            Call::from_id(id).map_or_else(|| format!("action {id}"), Call::text)
        }
    }

    fn finish(&mut self) {
        self.phase = Phase::Over;
        let contract = self.auction.contract();
        let ns = match self.declarer_tricks() {
            Some(tricks) if contract.level > 0 => {
                let side = partnership(contract.declarer);
                let s = score(&contract, tricks, self.vulnerable[side]) as f64;
                if side == 0 {
                    s
                } else {
                    -s
                }
            }
            _ => 0.0,
        };
        let ew = 0.0 - ns; // never -0.0, which would print as such
        self.returns = [ns, ew, ns, ew];
    }

    /// Applies action `id` for the acting seat; refused with the reason (state unchanged).
    pub fn apply_id(&mut self, id: u32) -> Result<(), ActionError> {
        let illegal = |reason: String| ActionError::Illegal { action: Self::action_text(id), reason };
        match self.phase {
            Phase::Over => Err(ActionError::EpisodeOver),
            Phase::Auction => {
                let call =
                    Call::from_id(id).ok_or_else(|| illegal("the auction is on: calls are ids 52 to 89".into()))?;
                self.auction.apply(call).map_err(illegal)?;
                if self.auction.is_over() {
                    let contract = self.auction.contract();
                    if contract.level == 0 || self.settings.bidding_only {
                        self.finish();
                    } else {
                        self.play = Some(Play::new(self.deal.hands(), contract.denomination, contract.declarer));
                        self.phase = Phase::Play;
                    }
                }
                Ok(())
            }
            Phase::Play => {
                if id >= 52 {
                    return Err(illegal("the play is on: cards are ids 0 to 51".into()));
                }
                let play = self.play.as_mut().expect("the play phase has a play");
                play.apply(Card(id as u8)).map_err(illegal)?;
                if play.is_over() {
                    self.finish();
                }
                Ok(())
            }
        }
    }

    /// Reads `seat`'s reply as the id of a legal call or card (see [`Environment::parse_action`]).
    pub fn parse_id(&self, seat: SeatId, text: &str) -> Result<u32, ActionError> {
        if self.phase == Phase::Over {
            return Err(ActionError::EpisodeOver);
        }
        if seat != self.acting_seat() {
            return Err(ActionError::NotToAct { seat });
        }
        let unparseable = |reason: String| ActionError::Unparseable { text: crate::text::shorten(text), reason };
        let id = match self.phase {
            Phase::Auction => parse::parse_call(text).map_err(unparseable)?.id(),
            _ => parse::parse_card(text).map_err(unparseable)?.0 as u32,
        };
        let illegal = |reason: String| ActionError::Illegal { action: Self::action_text(id), reason };
        match (self.phase, &self.play) {
            (Phase::Auction, _) => {
                let call = Call::from_id(id).expect("parsed calls have call ids");
                if let Some(reason) = self.auction.illegal_reason(call) {
                    return Err(illegal(reason));
                }
            }
            (_, Some(play)) => {
                if let Some(reason) = play.illegal_reason(Card(id as u8)) {
                    return Err(illegal(reason));
                }
            }
            (_, None) => return Err(ActionError::EpisodeOver),
        }
        Ok(id)
    }

    /// OpenSpiel's result line, e.g. `Score: N/S 110 E/W -110`.
    pub fn result_text(&self) -> String {
        format!("Score: N/S {} E/W {}", self.returns[0], self.returns[1])
    }
}

impl Environment for BridgeEnv {
    fn name(&self) -> &str {
        "bridge"
    }

    fn num_seats(&self) -> usize {
        4
    }

    fn reset(&mut self, seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (deal, dd) = match self.settings.boards.len() {
            0 => {
                let mut order: Vec<u32> = (0..52).collect();
                order.shuffle(&mut rng);
                (Deal::from_order(&order).expect("a shuffled pack is a valid deal"), None)
            }
            1 => (self.settings.boards[0].deal.clone(), self.settings.boards[0].dd),
            n => {
                let board = &self.settings.boards[rng.random_range(0..n)];
                (board.deal.clone(), board.dd)
            }
        };
        let (dealer, vulnerable) = match self.settings.board {
            BoardRule::Fixed { dealer, vulnerable } => (dealer, vulnerable),
            BoardRule::Numbered(b) => board_conditions(b),
            BoardRule::Rotating => board_conditions((seed % 16) as u32 + 1),
        };
        self.reset_with_deal(deal, dealer, vulnerable, dd);
    }

    fn acting_seats(&self) -> Vec<SeatId> {
        if self.phase == Phase::Over {
            Vec::new()
        } else {
            vec![self.acting_seat()]
        }
    }

    fn instructions(&self, seat: SeatId) -> String {
        observation::instructions_text(seat % 4, self.settings.bidding_only)
    }

    fn observation(&self, seat: SeatId) -> String {
        if seat >= 4 {
            return format!("There is no seat {seat}: bridge has seats 0 to 3 (N E S W).");
        }
        let legal: Vec<String> = self.legal_actions(seat).unwrap_or_default().into_iter().map(|a| a.text).collect();
        observation::observation_text(self, seat, &legal)
    }

    fn legal_actions(&self, seat: SeatId) -> Option<Vec<LegalAction>> {
        if self.phase == Phase::Over || seat != self.acting_seat() {
            return Some(Vec::new());
        }
        Some(self.legal_ids().into_iter().map(|id| LegalAction { id, text: Self::action_text(id) }).collect())
    }

    fn legal_action_ids(&self, seat: SeatId) -> Option<Vec<u32>> {
        if self.phase == Phase::Over || seat != self.acting_seat() {
            return Some(Vec::new());
        }
        Some(self.legal_ids())
    }

    fn parse_action(&self, seat: SeatId, text: &str) -> Result<Action, ActionError> {
        self.parse_id(seat, text).map(Action::Id)
    }

    fn step(&mut self, actions: &[Action]) -> Result<Vec<f64>, ActionError> {
        if self.phase == Phase::Over {
            return Err(ActionError::EpisodeOver);
        }
        let [action] = actions else {
            return Err(ActionError::WrongActionCount { expected: 1, got: actions.len() });
        };
        let id = match action {
            Action::Id(id) => *id,
            Action::Text(text) => self.parse_id(self.acting_seat(), text)?,
        };
        self.apply_id(id)?;
        Ok(if self.phase == Phase::Over { self.returns.to_vec() } else { vec![0.0; 4] })
    }

    fn is_terminal(&self) -> bool {
        self.phase == Phase::Over
    }

    fn returns(&self) -> Vec<f64> {
        self.returns.to_vec()
    }

    fn metrics(&self) -> EpisodeMetrics {
        let mut m = EpisodeMetrics::new();
        let contract = self.contract().unwrap_or(Contract { level: 0, denomination: 0, doubled: 1, declarer: 0 });
        let tricks = self.declarer_tricks();
        m.insert("score".into(), self.returns[0]);
        m.insert("score_ns".into(), self.returns[0]);
        m.insert("score_ew".into(), self.returns[1]);
        m.insert("passed_out".into(), if self.contract().is_some_and(|c| c.level == 0) { 1.0 } else { 0.0 });
        m.insert("contract_level".into(), contract.level as f64);
        m.insert("doubled".into(), if contract.doubled > 1 { 1.0 } else { 0.0 });
        m.insert("declarer_tricks".into(), tricks.unwrap_or(0) as f64);
        let made = tricks.is_some_and(|t| t >= 6 + contract.level as u32) && contract.level > 0;
        m.insert("contract_made".into(), if made { 1.0 } else { 0.0 });
        m.insert("calls".into(), self.auction.calls().len() as f64);
        m
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn board_numbers_set_dealer_and_vulnerability() {
        assert_eq!(board_conditions(1), (0, [false, false]));
        assert_eq!(board_conditions(2), (1, [true, false]));
        assert_eq!(board_conditions(3), (2, [false, true]));
        assert_eq!(board_conditions(4), (3, [true, true]));
        assert_eq!(board_conditions(13), (0, [true, true]));
        assert_eq!(board_conditions(16), (3, [false, true]));
        assert_eq!(board_conditions(17), board_conditions(1));
    }

    #[test]
    fn openspiel_vulnerability_knobs_follow_the_dealer() {
        let params =
            BridgeParams { dealer: Some(SeatSpec::Name("east".into())), dealer_vul: Some(true), ..Default::default() };
        let env = BridgeEnv::new(params.resolve().expect("valid"));
        assert_eq!(env.vulnerability(), [false, true]);
        assert_eq!(env.acting_seat(), 1);
    }

    #[test]
    fn conflicting_or_bad_params_name_the_field() {
        let err = BridgeParams { board: Some(3), dealer: Some(SeatSpec::Index(1)), ..Default::default() }
            .resolve()
            .unwrap_err();
        assert!(err.to_string().contains("board"), "{err}");
        let err = BridgeParams { vulnerability: Some("sometimes".into()), ..Default::default() }.resolve().unwrap_err();
        assert!(err.to_string().contains("vulnerability"), "{err}");
        let err = BridgeParams { bidding_only: true, ..Default::default() }.resolve().unwrap_err();
        assert!(err.to_string().contains("bidding_only"), "{err}");
        let err = BridgeParams { dealer: Some(SeatSpec::Index(7)), ..Default::default() }.resolve().unwrap_err();
        assert!(err.to_string().contains("dealer"), "{err}");
    }

    #[test]
    fn bidding_only_scores_from_the_double_dummy_table() {
        let mut dd = vec![vec![7u32; 4]; 5];
        dd[4] = vec![9, 4, 9, 4]; // NT: N/S take 9
        let params = BridgeParams {
            deal: Some("N:763.K3.AKQJ.QT97 QT.987542.T7.KJ3 A42.AQT6.86543.2 KJ985.J.92.A8654".into()),
            dd_table: Some(dd),
            bidding_only: true,
            ..Default::default()
        };
        let mut env = BridgeEnv::from_params(&serde_json::to_value(&params).expect("serializable")).expect("valid");
        env.reset(5);
        for call in [Call::Bid { level: 3, denomination: 4 }, Call::Pass, Call::Pass, Call::Pass] {
            env.step(&[Action::Id(call.id())]).expect("legal");
        }
        assert!(env.is_terminal());
        assert_eq!(env.returns(), vec![400.0, -400.0, 400.0, -400.0]);
        assert_eq!(env.metrics()["contract_made"], 1.0);
    }

    #[test]
    fn actions_of_the_wrong_phase_are_refused() {
        let mut env = BridgeEnv::new(BridgeParams::default().resolve().expect("valid"));
        let err = env.apply_id(12).unwrap_err();
        assert_eq!(err.to_string(), "illegal action C5: the auction is on: calls are ids 52 to 89");
        assert!(env.apply_id(90).is_err());
        for call in [55, 52, 52, 52] {
            env.apply_id(call).expect("legal");
        }
        let err = env.apply_id(52).unwrap_err();
        assert_eq!(err.to_string(), "illegal action Pass: the play is on: cards are ids 0 to 51");
        assert_eq!(
            env.step(&[Action::Id(1), Action::Id(2)]),
            Err(ActionError::WrongActionCount { expected: 1, got: 2 })
        );
    }

    #[test]
    fn passed_out_boards_score_zero() {
        let mut env = BridgeEnv::new(BridgeParams { board: Some(4), ..Default::default() }.resolve().expect("valid"));
        env.reset(1);
        assert_eq!(env.acting_seats(), vec![3], "West deals board 4");
        for _ in 0..4 {
            env.step(&[Action::Id(52)]).expect("pass");
        }
        assert!(env.is_terminal());
        assert_eq!(env.returns(), vec![0.0; 4]);
        assert_eq!(env.contract().map(|c| c.to_openspiel_string()), Some("Passed Out".into()));
        assert_eq!(env.metrics()["passed_out"], 1.0);
        assert_eq!(env.step(&[Action::Id(52)]), Err(ActionError::EpisodeOver));
    }

    #[test]
    fn bidding_only_from_a_deals_file() {
        let dir = std::env::temp_dir().join(format!("troupe-bridge-deals-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("deals.jsonl");
        let table = "[[8,5,8,5],[9,4,9,4],[6,7,6,7],[5,8,5,8],[9,4,9,4]]";
        std::fs::write(
            &path,
            format!(
                "{{\"pbn\": \"N:763.K3.AKQJ.QT97 QT.987542.T7.KJ3 A42.AQT6.86543.2 KJ985.J.92.A8654\", \"dd_table\": {table}}}\n\n\
                 {{\"pbn\": \"N:KQJ4.K82.865.654 987652.T975.J.Q9 T.Q63.QT7432.KJ3 A3.AJ4.AK9.AT872\", \"dd_table\": {table}}}\n"
            ),
        )
        .expect("writable");
        let params = serde_json::json!({"bidding_only": true, "deals_file": path.to_str().expect("utf8"), "vulnerability": "ns"});
        let mut env = BridgeEnv::from_params(&params).expect("valid");
        env.reset(9);
        for call in ["1D", "pass", "pass", "pass"] {
            let seat = env.acting_seats()[0];
            env.step(&[env.parse_action(seat, call).expect("legal")]).expect("legal");
        }
        // 1D by North with 9 tricks, vulnerable: 70 + 2 overtricks of 20.
        assert_eq!(env.returns()[0], 110.0);
        assert_eq!(env.declarer_tricks(), Some(9));
        std::fs::write(&path, "{\"pbn\": \"N:bad\"}\n").expect("writable");
        let err = BridgeEnv::from_params(&params).unwrap_err().to_string();
        assert!(err.contains("deals.jsonl") && err.contains("line 1"), "{err}");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn dummy_is_played_by_the_declarer_and_illegal_cards_are_refused() {
        let mut env = BridgeEnv::new(BridgeParams::default().resolve().expect("valid"));
        env.reset_with_deal(
            Deal::from_pbn("N:763.K3.AKQJ.QT97 QT.987542.T7.KJ3 A42.AQT6.86543.2 KJ985.J.92.A8654").expect("valid"),
            0,
            [false; 2],
            None,
        );
        // N 1NT, all pass: N declares, E leads, S is dummy.
        for text in ["1NT", "pass", "pass", "pass"] {
            let seat = env.acting_seats()[0];
            let action = env.parse_action(seat, text).expect("legal call");
            env.step(&[action]).expect("legal");
        }
        assert_eq!(env.acting_seats(), vec![1]);
        let err = env.parse_action(1, "SA").unwrap_err();
        assert_eq!(err.to_string(), "illegal action SA: East does not hold SA");
        env.step(&[env.parse_action(1, "H8").expect("legal lead")]).expect("legal");
        // South (dummy) is next: North acts and sees dummy's cards as legal.
        assert_eq!(env.acting_seats(), vec![0]);
        assert_eq!(env.legal_actions(2), Some(vec![]));
        let legal: Vec<String> = env.legal_actions(0).expect("finite").into_iter().map(|a| a.text).collect();
        assert_eq!(legal, ["H6", "HT", "HQ", "HA"]);
        let err = env.parse_action(0, "D3").unwrap_err();
        assert_eq!(err.to_string(), "illegal action D3: must follow suit: a heart was led");
        assert!(env.observation(0).contains("from dummy's hand (South)"));
        assert_eq!(env.parse_action(2, "HA"), Err(ActionError::NotToAct { seat: 2 }));
    }
}
