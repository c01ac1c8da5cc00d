//! Game records in the JSONL format of `fixtures/games/` (one whole game per line, action
//! ids as OpenSpiel numbers them): writing them from episodes played by a policy, and replaying
//! them move by move, checking every legal list, counter and final score.

use std::path::Path;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::bridge::{self, BridgeEnv};
use crate::environment::{Action, Environment};
use crate::error::EnvError;
use crate::hanabi::{Card, Event, HanabiEnv, HanabiParams, Move};
use crate::policy::Policy;
use crate::runner::policy_seed;

/// One step of a Hanabi record: a chance deal (`p` = -1) or a player's move with the counters
/// right after it, before the draw.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HanabiStep {
    /// The player, or -1 for a deal.
    pub p: i32,
    /// The dealt card's index, or HLE's move uid.
    pub a: u32,
    /// HLE's string for the deal or move.
    pub s: String,
    /// All legal uids before the move, sorted (player steps only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub legal: Option<Vec<u32>>,
    /// Life tokens after the move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub life: Option<u32>,
    /// Information tokens after the move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub info: Option<u32>,
    /// Fireworks per color after the move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fw: Option<Vec<u8>>,
    /// Cards left in the deck after the move, before the draw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deck: Option<usize>,
    /// Score change of the move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward: Option<f64>,
}

/// One whole Hanabi game.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HanabiRecord {
    /// Always `hanabi`.
    pub game: String,
    /// HLE parameters (absent keys take HLE's defaults).
    pub params: Map<String, Value>,
    /// The seed the game was played from.
    #[serde(default)]
    pub seed: u64,
    /// The policy that played.
    #[serde(default)]
    pub policy: String,
    /// Every card dealt, in order, as `color * ranks + rank`.
    pub deck_order: Vec<u32>,
    /// Deals and moves.
    pub steps: Vec<HanabiStep>,
    /// The final score.
    pub final_score: f64,
    /// Life tokens at the end.
    pub final_life: u32,
    /// Fireworks per color at the end.
    pub final_fireworks: Vec<u8>,
    /// Player moves made.
    pub num_player_moves: usize,
}

/// One step of a Bridge record (OpenSpiel's action ids; on dummy's turns `p` is the declarer).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BridgeStep {
    /// The seat that acts.
    pub p: i32,
    /// OpenSpiel's action id.
    pub a: u32,
    /// OpenSpiel's string for it.
    pub s: String,
    /// All legal ids before the action, sorted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub legal: Option<Vec<u32>>,
}

/// One whole Bridge board.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BridgeRecord {
    /// Always `bridge`.
    pub game: String,
    /// The seed the board was played from.
    #[serde(default)]
    pub seed: u64,
    /// Whether the play was replaced by a double-dummy result.
    #[serde(default)]
    pub dd: bool,
    /// OpenSpiel parameters: `dealer`, `dealer_vul`, `non_dealer_vul`, `use_double_dummy_result`.
    pub params: Map<String, Value>,
    /// The policy that played (absent in OpenSpiel's records).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    /// 52 card ids in dealing order (card i to seat i % 4).
    pub deal: Vec<u32>,
    /// The deal in PBN.
    pub pbn: String,
    /// Calls and plays.
    pub steps: Vec<BridgeStep>,
    /// The contract, e.g. `2CX N`, or `Passed Out`.
    pub contract: String,
    /// Tricks the declarer took (absent when passed out).
    #[serde(default)]
    pub declarer_tricks: Option<u32>,
    /// The duplicate score for N/S and E/W.
    pub returns_ns_ew: [f64; 2],
    /// OpenSpiel's result line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_text: Option<String>,
}

/// The outcome of replaying the records of one or more files.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ReplayReport {
    /// Records that replayed exactly.
    pub passed: usize,
    /// Records that did not.
    pub failed: usize,
    /// One line per failed record: file, line and the first mismatch.
    pub failures: Vec<String>,
}

impl ReplayReport {
    /// Adds another report's counts and failures to this one.
    pub fn merge(&mut self, other: ReplayReport) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.failures.extend(other.failures);
    }
}

fn check<T: PartialEq + std::fmt::Debug>(what: &str, expected: &T, got: &T) -> Result<(), String> {
    if expected == got {
        Ok(())
    } else {
        Err(format!("{what}: expected {expected:?}, got {got:?}"))
    }
}

fn hanabi_params_of(params: &Map<String, Value>) -> Result<HanabiParams, String> {
    // Records may carry OpenSpiel-only keys; keep the ones that change the rules.
    let known =
        ["players", "colors", "ranks", "hand_size", "max_information_tokens", "max_life_tokens", "random_start_player"];
    let kept: Map<String, Value> =
        params.iter().filter(|(k, _)| known.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.clone())).collect();
    serde_json::from_value(Value::Object(kept)).map_err(|e| format!("params: {e}"))
}

/// Replays one Hanabi record; `Err` names the first step that differs.
pub fn replay_hanabi(record: &HanabiRecord) -> Result<(), String> {
    let config = hanabi_params_of(&record.params)?.resolve().map_err(|e| e.to_string())?;
    let deck: Vec<Card> = record
        .deck_order
        .iter()
        .map(|&i| {
            if (i as usize) < config.colors * config.ranks {
                Ok(Card::from_index(i, config.ranks))
            } else {
                Err(format!("deck_order: card {i} out of range"))
            }
        })
        .collect::<Result<_, _>>()?;
    // Records hold the dealt cards only; the rest of the deck is never seen. Complete it.
    let mut full = deck.clone();
    let mut counts = vec![0usize; config.colors * config.ranks];
    for card in &deck {
        counts[card.index(config.ranks) as usize] += 1;
    }
    for (index, &count) in counts.iter().enumerate() {
        let card = Card::from_index(index as u32, config.ranks);
        let copies = config.copies(card.rank as usize);
        if count > copies {
            return Err(format!("deck_order holds {count} copies of {card}, the deck has {copies}"));
        }
        full.extend(std::iter::repeat_n(card, copies - count));
    }
    let start = record.steps.iter().find(|s| s.p >= 0).map_or(0, |s| s.p as usize);
    let mut env = HanabiEnv::new(config.clone());
    env.reset_with_deck(full, start).map_err(|e| e.to_string())?;
    let mut deals_seen = 0usize;
    let initial_deals: Vec<(usize, Card)> = env
        .state()
        .events()
        .iter()
        .filter_map(|e| if let Event::Deal { player, card } = e { Some((*player, *card)) } else { None })
        .collect();
    for (n, step) in record.steps.iter().enumerate() {
        let at = |msg: String| format!("step {n} ({}): {msg}", step.s);
        if step.p < 0 {
            let card = if deals_seen < initial_deals.len() {
                deals_seen += 1;
                Some(initial_deals[deals_seen - 1].1)
            } else {
                if !env.state().draw_pending() {
                    return Err(at("a deal where no card is owed".into()));
                }
                env.draw()
            };
            let card = card.ok_or_else(|| at("the deck is empty".into()))?;
            check("dealt card", &step.a, &card.index(config.ranks)).map_err(at)?;
            check("deal string", &step.s, &format!("(Deal {card})")).map_err(at)?;
            continue;
        }
        if env.state().draw_pending() {
            return Err(at("a card is owed to the last mover but the record deals none".into()));
        }
        check("player", &(step.p as usize), &env.state().current_player()).map_err(at)?;
        let legal: Vec<u32> = env.state().legal_moves().iter().map(|m| m.uid(&config)).collect();
        if let Some(expected) = &step.legal {
            check("legal moves", expected, &legal).map_err(at)?;
        }
        let mv = Move::from_uid(step.a, &config).ok_or_else(|| at(format!("uid {} out of range", step.a)))?;
        check("move string", &step.s, &mv.hle_string()).map_err(at)?;
        let reward = env.apply_without_draw(mv).map_err(|e| at(e.to_string()))?;
        let s = env.state();
        if let Some(life) = step.life {
            check("life tokens", &life, &s.life_tokens()).map_err(at)?;
        }
        if let Some(info) = step.info {
            check("information tokens", &info, &s.information_tokens()).map_err(at)?;
        }
        if let Some(fw) = &step.fw {
            check("fireworks", &fw.as_slice(), &s.fireworks()).map_err(at)?;
        }
        if let Some(deck) = step.deck {
            check("deck size", &deck, &s.deck_size()).map_err(at)?;
        }
        if let Some(r) = step.reward {
            check("reward", &r, &(reward as f64)).map_err(at)?;
        }
    }
    let s = env.state();
    if !s.is_terminal() {
        return Err("the record ends before the game is over".into());
    }
    check("final score", &record.final_score, &(s.score() as f64))?;
    check("final life tokens", &record.final_life, &s.life_tokens())?;
    check("final fireworks", &record.final_fireworks.as_slice(), &s.fireworks())?;
    check("player moves", &record.num_player_moves, &s.player_moves())?;
    Ok(())
}

fn bridge_conditions(params: &Map<String, Value>) -> Result<(usize, [bool; 2], bool), String> {
    let dealer = match params.get("dealer") {
        None => 0,
        Some(v) => {
            v.as_u64().filter(|&d| d < 4).ok_or_else(|| format!("params.dealer: {v} is not a seat 0..4"))? as usize
        }
    };
    let flag = |key: &str| -> Result<bool, String> {
        match params.get(key) {
            None => Ok(false),
            Some(v) => v.as_bool().ok_or_else(|| format!("params.{key}: {v} is not true or false")),
        }
    };
    let (dealer_vul, other_vul) = (flag("dealer_vul")?, flag("non_dealer_vul")?);
    let vulnerable =
        if bridge::cards::partnership(dealer) == 0 { [dealer_vul, other_vul] } else { [other_vul, dealer_vul] };
    Ok((dealer, vulnerable, flag("use_double_dummy_result")?))
}

/// Replays one Bridge record; `Err` names the first step that differs.
pub fn replay_bridge(record: &BridgeRecord) -> Result<(), String> {
    let (dealer, vulnerable, dd) = bridge_conditions(&record.params)?;
    if dd || record.dd {
        return Err("double-dummy records need the double-dummy solver's tricks, which records do not carry".into());
    }
    let deal = bridge::Deal::from_order(&record.deal).map_err(|e| format!("deal: {e}"))?;
    check("pbn", &record.pbn, &deal.to_pbn())?;
    let mut env = BridgeEnv::new(bridge::BridgeParams::default().resolve().map_err(|e| e.to_string())?);
    env.reset_with_deal(deal, dealer, vulnerable, None);
    for (n, step) in record.steps.iter().enumerate() {
        let at = |msg: String| format!("step {n} ({}): {msg}", step.s);
        if env.is_terminal() {
            return Err(at("the board is already over".into()));
        }
        check("seat", &step.p, &(env.acting_seat() as i32)).map_err(at)?;
        if let Some(expected) = &step.legal {
            check("legal actions", expected, &env.legal_ids()).map_err(at)?;
        }
        check("action string", &step.s, &BridgeEnv::action_text(step.a)).map_err(at)?;
        env.apply_id(step.a).map_err(|e| at(e.to_string()))?;
    }
    if !env.is_terminal() {
        return Err("the record ends before the board is over".into());
    }
    let contract = env.contract().map(|c| c.to_openspiel_string()).unwrap_or_default();
    check("contract", &record.contract, &contract)?;
    check("declarer tricks", &record.declarer_tricks, &env.declarer_tricks())?;
    check("returns", &record.returns_ns_ew, &env.returns_ns_ew())?;
    if let Some(text) = &record.result_text {
        check("result text", &text.lines().last().unwrap_or_default().to_string(), &env.result_text())?;
    }
    Ok(())
}

/// Replays one JSONL line of any game; `Err` says what differs or what is malformed.
pub fn replay_line(line: &str) -> Result<(), String> {
    let value: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    match value.get("game").and_then(Value::as_str) {
        Some("hanabi") => replay_hanabi(&serde_json::from_value(value).map_err(|e| format!("hanabi record: {e}"))?),
        Some("bridge") => replay_bridge(&serde_json::from_value(value).map_err(|e| format!("bridge record: {e}"))?),
        Some(other) => Err(format!("field game: {other:?} is not hanabi or bridge")),
        None => Err("missing string field `game`".to_string()),
    }
}

/// Replays every record of a JSONL file. An unreadable file is an error; a record that does not
/// replay is counted as failed with `path:line: reason`.
pub fn replay_file(path: &Path) -> Result<ReplayReport, EnvError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| EnvError::Data { path: path.display().to_string(), message: e.to_string() })?;
    let mut report = ReplayReport::default();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        match replay_line(line) {
            Ok(()) => report.passed += 1,
            Err(reason) => {
                report.failed += 1;
                report.failures.push(format!("{}:{}: {reason}", path.display(), n + 1));
            }
        }
    }
    Ok(report)
}

fn action_error(env: &dyn Environment, error: crate::environment::ActionError) -> EnvError {
    EnvError::Action { env: env.name().to_string(), error }
}

/// Plays one Hanabi game with `policy` from `seed` and records it.
pub fn record_hanabi(env: &mut HanabiEnv, policy: &mut dyn Policy, seed: u64) -> Result<HanabiRecord, EnvError> {
    env.reset(seed);
    let mut rng = ChaCha8Rng::seed_from_u64(policy_seed(seed));
    let config = env.config().clone();
    let mut steps: Vec<HanabiStep> = Vec::new();
    let mut seen = 0usize;
    let push_events = |env: &HanabiEnv, seen: &mut usize, steps: &mut Vec<HanabiStep>, legal: Option<Vec<u32>>| {
        let mut legal = legal;
        for event in &env.state().events()[*seen..] {
            steps.push(match event {
                Event::Deal { card, .. } => HanabiStep {
                    p: -1,
                    a: card.index(config.ranks),
                    s: format!("(Deal {card})"),
                    legal: None,
                    life: None,
                    info: None,
                    fw: None,
                    deck: None,
                    reward: None,
                },
                Event::Move { player, mv, reward, after, .. } => HanabiStep {
                    p: *player as i32,
                    a: mv.uid(&config),
                    s: mv.hle_string(),
                    legal: legal.take(),
                    life: Some(after.life),
                    info: Some(after.info),
                    fw: Some(after.fireworks.clone()),
                    deck: Some(after.deck),
                    reward: Some(*reward as f64),
                },
            });
        }
        *seen = env.state().events().len();
    };
    push_events(env, &mut seen, &mut steps, None);
    while !env.is_terminal() {
        let seat = env.state().current_player();
        let legal: Vec<u32> = env.state().legal_moves().iter().map(|m| m.uid(&config)).collect();
        let action = policy.act(&*env, seat, &mut rng)?;
        env.step(std::slice::from_ref(&action)).map_err(|e| action_error(&*env, e))?;
        push_events(env, &mut seen, &mut steps, Some(legal));
    }
    let mut params = Map::new();
    for (key, value) in [
        ("players", config.players as u64),
        ("colors", config.colors as u64),
        ("ranks", config.ranks as u64),
        ("hand_size", config.hand_size as u64),
        ("max_information_tokens", config.max_information_tokens as u64),
        ("max_life_tokens", config.max_life_tokens as u64),
    ] {
        params.insert(key.to_string(), Value::from(value));
    }
    params.insert("random_start_player".into(), Value::from(config.random_start_player));
    let state = env.state();
    let deck_order = state
        .events()
        .iter()
        .filter_map(|e| if let Event::Deal { card, .. } = e { Some(card.index(config.ranks)) } else { None })
        .collect();
    Ok(HanabiRecord {
        game: "hanabi".into(),
        params,
        seed,
        policy: policy.name().to_string(),
        deck_order,
        steps,
        final_score: state.score() as f64,
        final_life: state.life_tokens(),
        final_fireworks: state.fireworks().to_vec(),
        num_player_moves: state.player_moves(),
    })
}

/// Plays one Bridge board with `policy` in every seat from `seed` and records it.
pub fn record_bridge(env: &mut BridgeEnv, policy: &mut dyn Policy, seed: u64) -> Result<BridgeRecord, EnvError> {
    if env.bidding_only() {
        return Err(EnvError::BadParam {
            env: "bridge".into(),
            field: "bidding_only".into(),
            message: "game records hold played boards; record without bidding_only".into(),
        });
    }
    env.reset(seed);
    let mut rng = ChaCha8Rng::seed_from_u64(policy_seed(seed));
    let mut steps = Vec::new();
    while !env.is_terminal() {
        let seat = env.acting_seat();
        let legal = env.legal_ids();
        let action = policy.act(&*env, seat, &mut rng)?;
        env.step(std::slice::from_ref(&action)).map_err(|e| action_error(&*env, e))?;
        let Action::Id(a) = action else {
            return Err(EnvError::Policy {
                policy: policy.name().into(),
                env: "bridge".into(),
                message: "answered with text".into(),
            });
        };
        steps.push(BridgeStep { p: seat as i32, a, s: BridgeEnv::action_text(a), legal: Some(legal) });
    }
    let dealer = env.auction().dealer();
    let vul = env.vulnerability();
    let side = bridge::cards::partnership(dealer);
    let mut params = Map::new();
    params.insert("dealer".into(), Value::from(dealer as u64));
    params.insert("dealer_vul".into(), Value::from(vul[side]));
    params.insert("non_dealer_vul".into(), Value::from(vul[1 - side]));
    params.insert("use_double_dummy_result".into(), Value::from(false));
    Ok(BridgeRecord {
        game: "bridge".into(),
        seed,
        dd: false,
        params,
        policy: Some(policy.name().to_string()),
        deal: env.deal().order(),
        pbn: env.deal().to_pbn(),
        steps,
        contract: env.contract().map(|c| c.to_openspiel_string()).unwrap_or_default(),
        declarer_tricks: env.declarer_tricks(),
        returns_ns_ew: env.returns_ns_ew(),
        result_text: Some(env.result_text()),
    })
}

/// Plays `episodes` games of the environment built from `name` and `params` (seeds `seed`,
/// `seed + 1`, ...) with `policy` and returns their records as JSONL lines.
pub fn record_episodes(
    registry: &crate::Registry,
    name: &str,
    params: &Value,
    episodes: usize,
    seed: u64,
    policy: &mut dyn Policy,
) -> Result<Vec<String>, EnvError> {
    let env = registry.make(name, params)?;
    let mut lines = Vec::with_capacity(episodes);
    let any = env.as_any();
    let to_line = |value: Result<String, serde_json::Error>| {
        value.map_err(|e| EnvError::Data { path: "<record>".into(), message: e.to_string() })
    };
    if let Some(hanabi) = any.downcast_ref::<HanabiEnv>() {
        let mut hanabi = hanabi.clone();
        for i in 0..episodes {
            let record = record_hanabi(&mut hanabi, policy, seed.wrapping_add(i as u64))?;
            lines.push(to_line(serde_json::to_string(&record))?);
        }
    } else if let Some(bridge_env) = any.downcast_ref::<BridgeEnv>() {
        let mut bridge_env = bridge_env.clone();
        for i in 0..episodes {
            let record = record_bridge(&mut bridge_env, policy, seed.wrapping_add(i as u64))?;
            lines.push(to_line(serde_json::to_string(&record))?);
        }
    } else {
        return Err(EnvError::BadParam {
            env: name.to_string(),
            field: "name".into(),
            message: "game records exist for hanabi and bridge only".into(),
        });
    }
    Ok(lines)
}
