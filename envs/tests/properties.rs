//! Property tests: thousands of random games of every Hanabi variant and of Bridge never panic,
//! always end, and keep their invariants after every step (card counts, token bounds, score
//! bounds, knowledge consistent with the cards, every legal action's text parsing back to it).

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use troupe_envs::bridge::{BridgeEnv, Phase};
use troupe_envs::hanabi::rule_player::HanabiRulePolicy;
use troupe_envs::hanabi::HanabiEnv;
use troupe_envs::policy::{Policy, RandomPolicy};
use troupe_envs::{Action, Environment, Registry};

fn hanabi_invariants(env: &HanabiEnv) -> Result<(), TestCaseError> {
    let s = env.state();
    let c = env.config();
    let in_hands: usize = s.hands().iter().map(Vec::len).sum();
    let on_fireworks: usize = s.fireworks().iter().map(|&f| f as usize).sum();
    prop_assert_eq!(in_hands + s.deck_size() + s.discards().len() + on_fireworks, c.deck_size(), "cards are conserved");
    prop_assert!(s.information_tokens() <= c.max_information_tokens);
    prop_assert!(s.life_tokens() <= c.max_life_tokens);
    prop_assert!(s.score() <= c.max_score());
    prop_assert!(s.fireworks().iter().all(|&f| (f as usize) <= c.ranks));
    for hand in s.hands() {
        prop_assert!(hand.len() <= c.hand_size);
        for held in hand {
            prop_assert!(held.knowledge.color_plausible(held.card.color), "knowledge excludes the true color");
            prop_assert!(held.knowledge.rank_plausible(held.card.rank), "knowledge excludes the true rank");
        }
    }
    let returns = env.returns();
    prop_assert!(returns.iter().all(|&r| r == s.score() as f64), "every seat's return is the score");
    Ok(())
}

/// Every legal action's canonical text parses back to the same id.
fn texts_round_trip(env: &dyn Environment) -> Result<(), TestCaseError> {
    for seat in env.acting_seats() {
        let legal = env.legal_actions(seat).unwrap_or_default();
        prop_assert!(!legal.is_empty(), "an acting seat has a legal action");
        for action in legal {
            let parsed = env.parse_action(seat, &action.text);
            prop_assert_eq!(parsed, Ok(Action::Id(action.id)), "text {:?}", action.text);
        }
    }
    Ok(())
}

fn play_hanabi(params: serde_json::Value, seed: u64, rule: bool, check_text: bool) -> Result<(), TestCaseError> {
    let registry = Registry::with_builtins();
    let mut env = registry.make("hanabi", &params).map_err(|e| TestCaseError::fail(e.to_string()))?;
    env.reset(seed);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut random = RandomPolicy;
    let mut rules = HanabiRulePolicy;
    let mut steps = 0;
    let bound = 200; // each move spends a deck card, a token or a life; far below this
    while !env.is_terminal() {
        prop_assert!(steps < bound, "game did not end within {} moves", bound);
        if check_text {
            texts_round_trip(env.as_ref())?;
        }
        let seat = env.acting_seats()[0];
        let policy: &mut dyn Policy = if rule && rng.random_bool(0.8) { &mut rules } else { &mut random };
        let action = policy.act(env.as_ref(), seat, &mut rng).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let rewards = env.step(&[action]).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(rewards.len(), env.num_seats());
        let hanabi = env.as_any().downcast_ref::<HanabiEnv>().expect("a Hanabi environment");
        hanabi_invariants(hanabi)?;
        steps += 1;
    }
    prop_assert!(env.acting_seats().is_empty());
    prop_assert_eq!(env.step(&[Action::Id(0)]), Err(troupe_envs::ActionError::EpisodeOver));
    let score = env.metrics()["score"];
    prop_assert!(env.returns().iter().all(|&r| r == score));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn hanabi_full_games(seed in any::<u64>(), players in 2usize..=5, rule in any::<bool>(), random_start in any::<bool>()) {
        play_hanabi(json!({"players": players, "random_start_player": random_start}), seed, rule, seed % 4 == 0)?;
    }

    #[test]
    fn hanabi_small_games(seed in any::<u64>(), players in 2usize..=5, rule in any::<bool>()) {
        play_hanabi(json!({"variant": "small", "players": players}), seed, rule, seed % 4 == 0)?;
    }

    #[test]
    fn hanabi_very_small_games(seed in any::<u64>(), players in 2usize..=5, rule in any::<bool>()) {
        play_hanabi(json!({"variant": "very_small", "players": players}), seed, rule, seed % 4 == 0)?;
    }

    #[test]
    fn bridge_boards(seed in any::<u64>(), rotate in any::<bool>()) {
        let params = if rotate { json!({"rotate_boards": true}) } else { json!({}) };
        let mut env = BridgeEnv::from_params(&params).map_err(|e| TestCaseError::fail(e.to_string()))?;
        env.reset(seed);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut steps = 0;
        while !env.is_terminal() {
            // An auction has at most 319 calls; then 52 cards.
            prop_assert!(steps < 319 + 52, "board did not end");
            if seed % 4 == 0 {
                texts_round_trip(&env)?;
            }
            let seat = env.acting_seats()[0];
            let action = RandomPolicy.act(&env, seat, &mut rng).map_err(|e| TestCaseError::fail(e.to_string()))?;
            env.step(&[action]).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let hands = env.current_hands();
            let held: u32 = hands.iter().map(|h| h.count_ones()).sum();
            let played = env.play().map_or(0, |p| p.tricks().len() * 4 + p.current_trick().1.len()) as u32;
            prop_assert_eq!(held + played, 52, "cards are conserved");
            prop_assert!(hands.iter().all(|h| hands.iter().filter(|o| *o != h).all(|o| o & h == 0)), "no card in two hands");
            if let Some(play) = env.play() {
                prop_assert!(play.declarer_tricks() as usize <= play.tricks().len());
            }
            steps += 1;
        }
        prop_assert_eq!(env.phase(), Phase::Over);
        let r = env.returns();
        prop_assert_eq!(r[0], r[2]);
        prop_assert_eq!(r[1], r[3]);
        prop_assert_eq!(r[0] + r[1], 0.0, "duplicate scores are zero-sum");
        prop_assert!(r[0].abs() <= 7600.0, "no bridge score exceeds 7600");
        let contract = env.contract().expect("the auction is over");
        if contract.level > 0 {
            prop_assert_eq!(env.play().map(|p| p.tricks().len()), Some(13));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    /// The fast id lists agree with the full legal lists at every step.
    #[test]
    fn legal_ids_match_legal_actions(seed in any::<u64>(), players in 2usize..=5) {
        let registry = Registry::with_builtins();
        for (name, params) in [("hanabi", json!({"players": players})), ("bridge", json!({}))] {
            let mut env = registry.make(name, &params).map_err(|e| TestCaseError::fail(e.to_string()))?;
            env.reset(seed);
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            while !env.is_terminal() {
                for seat in 0..env.num_seats() {
                    let full: Option<Vec<u32>> = env.legal_actions(seat).map(|l| l.into_iter().map(|a| a.id).collect());
                    prop_assert_eq!(env.legal_action_ids(seat), full);
                }
                let seat = env.acting_seats()[0];
                let action = RandomPolicy.act(env.as_ref(), seat, &mut rng).map_err(|e| TestCaseError::fail(e.to_string()))?;
                env.step(&[action]).map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    /// Any deal survives a PBN round trip, written from any first seat.
    #[test]
    fn pbn_round_trips(order in Just((0u32..52).collect::<Vec<_>>()).prop_shuffle(), first in 0usize..4) {
        use troupe_envs::bridge::Deal;
        let deal = Deal::from_order(&order).map_err(TestCaseError::fail)?;
        let pbn = deal.to_pbn();
        let back = Deal::from_pbn(&pbn).map_err(TestCaseError::fail)?;
        prop_assert_eq!(back.hands(), deal.hands());
        prop_assert_eq!(back.to_pbn(), pbn.clone());
        // The same deal written from another first seat: rotate the four hands.
        let hands: Vec<&str> = pbn[2..].split(' ').collect();
        let rotated: Vec<&str> = (0..4).map(|k| hands[(first + k) % 4]).collect();
        let other = format!("{}:{}", ['N', 'E', 'S', 'W'][first], rotated.join(" "));
        prop_assert_eq!(Deal::from_pbn(&other).map_err(TestCaseError::fail)?.hands(), deal.hands());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, failure_persistence: None, ..ProptestConfig::default() })]

    /// Any valid combination of HLE's knobs plays to the end with the invariants intact; an
    /// invalid one is refused with the field named, never a panic.
    #[test]
    fn hanabi_any_knobs(
        seed in any::<u64>(),
        players in 2usize..=5,
        colors in 1usize..=5,
        ranks in 1usize..=5,
        hand_size in 1usize..=8,
        info in 0u32..=8,
        life in 1u32..=4,
        rule in any::<bool>(),
    ) {
        let params = json!({
            "players": players, "colors": colors, "ranks": ranks, "hand_size": hand_size,
            "max_information_tokens": info, "max_life_tokens": life,
        });
        match HanabiEnv::from_params(&params) {
            Ok(_) => play_hanabi(params, seed, rule, seed % 8 == 0)?,
            Err(err) => prop_assert!(err.to_string().contains("hand_size"), "{}", err),
        }
    }
}
