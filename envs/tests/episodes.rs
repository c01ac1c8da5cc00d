//! Whole episodes: seeding, observations, baseline policies, benchmarks, recording and
//! replaying, and the interactive loop.

use serde_json::json;
use troupe_envs::hanabi::rule_player::HanabiRulePolicy;
use troupe_envs::hanabi::{Card, HanabiEnv, Move};
use troupe_envs::policy::RandomPolicy;
use troupe_envs::records::{record_episodes, replay_line};
use troupe_envs::runner::{bench, play_interactive, run_episode};
use troupe_envs::{Action, Environment, Registry};

#[test]
fn same_seed_same_episode() {
    let registry = Registry::with_builtins();
    for (name, params) in [("hanabi", json!({"players": 4})), ("bridge", json!({"rotate_boards": true}))] {
        let mut a = registry.make(name, &params).expect("valid");
        let mut b = registry.make(name, &params).expect("valid");
        let ra = run_episode(a.as_mut(), &mut RandomPolicy, 42).expect("runs");
        let rb = run_episode(b.as_mut(), &mut RandomPolicy, 42).expect("runs");
        assert_eq!((ra.steps, ra.returns.clone()), (rb.steps, rb.returns.clone()), "{name}");
        assert_eq!(a.observation(0), b.observation(0), "{name}");
        let rc = run_episode(a.as_mut(), &mut RandomPolicy, 43).expect("runs");
        assert!(rc.steps != ra.steps || a.observation(0) != b.observation(0), "{name}: another seed, another episode");
    }
}

#[test]
fn hanabi_observation_shows_what_the_player_may_know() {
    let registry = Registry::with_builtins();
    let mut env = registry.make("hanabi", &json!({"players": 3})).expect("valid");
    env.reset(7);
    let text = env.observation(0);
    assert!(text.contains("You are player 0") && text.contains("It is your turn"), "{text}");
    assert!(text.contains("Information tokens: 8 of 8. Life tokens: 3 of 3. Cards left in the deck: 35."), "{text}");
    assert!(text.contains("card 1: color ?, rank ? (could be colors RYGWB, ranks 12345)"), "{text}");
    assert!(text.contains("Player 1's hand") && text.contains("Player 2's hand"), "{text}");
    assert!(text.contains("Legal actions: play card 1;"), "{text}");
    let hint = env
        .legal_actions(0)
        .expect("finite")
        .into_iter()
        .find(|a| a.text.starts_with("hint player 1 rank"))
        .expect("a rank hint");
    env.step(&[troupe_envs::Action::Id(hint.id)]).expect("legal");
    let seen_by_1 = env.observation(1);
    assert!(seen_by_1.contains("player 0 told you: rank"), "{seen_by_1}");
    assert!(seen_by_1.contains("It is your turn"), "{seen_by_1}");
    assert!(!env.observation(2).contains("Legal actions"), "only the player to act gets the list");
    assert!(env.instructions(0).contains("<answer>hint player 1 red</answer>"));
}

#[test]
fn bridge_observation_hides_other_hands() {
    let registry = Registry::with_builtins();
    let mut env = registry.make("bridge", &json!({"dealer": "S", "vulnerability": "both"})).expect("valid");
    env.reset(3);
    let text = env.observation(2);
    assert!(text.contains("You are South; your partner is North. Dealer: South. Vulnerable: Both."), "{text}");
    assert!(text.contains("Your hand: Spades:"), "{text}");
    assert!(text.contains("It is your turn to call."), "{text}");
    assert_eq!(text.matches("Spades:").count(), 1, "no other hand is shown during the auction");
    assert!(env.observation(0).contains("Waiting for South."));
}

#[test]
fn rule_based_hanabi_beats_random() {
    let registry = Registry::with_builtins();
    let mut env = registry.make("hanabi", &json!({"players": 2})).expect("valid");
    let random = bench(env.as_mut(), &mut RandomPolicy, 100, 0).expect("runs");
    let rule = bench(env.as_mut(), &mut HanabiRulePolicy, 100, 0).expect("runs");
    assert!(rule.mean_score > random.mean_score + 5.0, "rule {} vs random {}", rule.mean_score, random.mean_score);
    assert_eq!(rule.episodes, 100);
    assert!(rule.steps_per_second > 0.0 && rule.mean_length > 10.0);
    let bridge = registry.make("bridge", &json!({})).expect("valid");
    let err = HanabiRulePolicy.act_on(bridge.as_ref());
    assert!(err.contains("Hanabi only"), "{err}");
    assert!(registry.make_policy("smart").err().expect("unknown").to_string().contains("random, rule"));
}

/// A helper so the test above reads simply.
trait ActOn {
    fn act_on(&mut self, env: &dyn Environment) -> String;
}

impl ActOn for HanabiRulePolicy {
    fn act_on(&mut self, env: &dyn Environment) -> String {
        use rand::SeedableRng;
        use troupe_envs::policy::Policy;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
        self.act(env, 0, &mut rng).err().map(|e| e.to_string()).unwrap_or_default()
    }
}

#[test]
fn recorded_games_replay() {
    let registry = Registry::with_builtins();
    for (name, params, policy) in [
        ("hanabi", json!({"players": 2}), "rule"),
        ("hanabi", json!({"players": 5, "random_start_player": true}), "random"),
        ("hanabi", json!({"variant": "small", "players": 3}), "rule"),
        ("hanabi", json!({"variant": "very_small", "players": 5}), "random"),
        ("bridge", json!({"rotate_boards": true}), "random"),
    ] {
        let mut policy = registry.make_policy(policy).expect("known");
        let lines = record_episodes(&registry, name, &params, 8, 100, policy.as_mut()).expect("records");
        assert_eq!(lines.len(), 8);
        for line in &lines {
            replay_line(line).unwrap_or_else(|e| panic!("{name} {params}: {e}\n{line}"));
        }
    }
    let err = record_episodes(&registry, "bridge", &json!({}), 1, 0, &mut HanabiRulePolicy).unwrap_err();
    assert!(err.to_string().contains("Hanabi only"), "{err}");
}

#[test]
fn a_person_can_play_a_seat() {
    let registry = Registry::with_builtins();
    let mut env = registry.make("hanabi", &json!({"players": 2})).expect("valid");
    // Garbage first, then an illegal move, then legal hints and plays until the input runs out.
    let mut input: &[u8] = b"banana\ndiscard card 1\nplay card 1\nplay card 1\nplay card 1\nplay card 1\n";
    let mut output = Vec::new();
    let result = play_interactive(env.as_mut(), 0, &mut HanabiRulePolicy, 5, &mut input, &mut output).expect("plays");
    let text = String::from_utf8(output).expect("utf8");
    assert!(text.contains("Not accepted: cannot read \"banana\""), "{text}");
    assert!(text.contains("Not accepted: illegal action discard card 1: cannot discard"), "{text}");
    assert!(text.contains("[seat 0] your action>"), "{text}");
    assert!(result.steps >= 2, "the person's moves and the policy's replies were applied");
}

#[test]
fn hanabi_life_loss_penalty_shapes_rewards_but_not_the_score() {
    let registry = Registry::with_builtins();
    let mut plain = registry.make_from_spec(&serde_json::json!({"name": "hanabi", "players": 2})).unwrap();
    let mut shaped = registry
        .make_from_spec(&serde_json::json!({"name": "hanabi", "players": 2, "life_loss_penalty": 0.5}))
        .unwrap();
    plain.reset(11);
    shaped.reset(11);
    let mut lives_lost_seen = 0.0;
    while !plain.is_terminal() {
        let seat = plain.acting_seats()[0];
        // Always play the oldest card: lives are lost quickly.
        let id = plain.legal_actions(seat).unwrap().into_iter().find(|a| a.text.starts_with("play")).unwrap().id;
        let a = plain.step(&[troupe_envs::Action::Id(id)]).unwrap();
        let b = shaped.step(&[troupe_envs::Action::Id(id)]).unwrap();
        let lost = plain.metrics()["lives_lost"] - lives_lost_seen;
        lives_lost_seen = plain.metrics()["lives_lost"];
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(*y, x - 0.5 * lost, "a lost life costs the penalty, nothing else changes");
        }
    }
    assert!(lives_lost_seen > 0.0);
    assert!(shaped.is_terminal());
    assert_eq!(plain.metrics(), shaped.metrics(), "metrics, score included, are the game's");
    assert_eq!(shaped.returns()[0], plain.returns()[0] - 0.5 * lives_lost_seen);
    let err = registry
        .make_from_spec(&serde_json::json!({"name": "hanabi", "life_loss_penalty": -1.0}))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("life_loss_penalty"), "{err}");
}

/// Two-player Hanabi (`params` over the defaults) dealt from `front` then the rest of the deck in
/// index order: player 0 holds the first `hand_size` cards of `front`, player 1 the next ones.
fn hanabi_dealt(params: serde_json::Value, front: &[Card]) -> HanabiEnv {
    let mut env = HanabiEnv::from_params(&params).expect("valid params");
    let config = env.config().clone();
    let mut rest = Vec::new();
    for color in 0..config.colors as u8 {
        for rank in 0..config.ranks as u8 {
            (0..config.copies(rank as usize)).for_each(|_| rest.push(Card::new(color, rank)));
        }
    }
    for card in front {
        let at = rest.iter().position(|c| c == card).expect("the card is in the deck");
        rest.remove(at);
    }
    env.reset_with_deck(front.iter().copied().chain(rest).collect(), 0).expect("valid deck");
    env
}

#[test]
fn hanabi_hint_reward_pays_for_news_about_playable_cards_only() {
    let (r, y) = (|rank| Card::new(0, rank), |rank| Card::new(1, rank));
    // Player 0: R2 R2 R3 R3 R4 (nothing playable); player 1: R1 R1 Y1 R4 Y5.
    let front = [r(1), r(1), r(2), r(2), r(3), r(0), r(0), y(0), r(3), y(4)];
    let mut plain = hanabi_dealt(json!({"players": 2}), &front);
    let mut shaped = hanabi_dealt(json!({"players": 2, "hint_reward": 0.5}), &front);
    let hint_rank = |rank| Move::RevealRank { offset: 1, rank };
    let hint_color = |color| Move::RevealColor { offset: 1, color };
    for (mv, paid) in [
        (hint_rank(0), true),   // P0 -> P1 "1": R1 R1 Y1, playable, new
        (hint_rank(3), false),  // P1 -> P0 "4": R4 is not playable
        (hint_rank(0), false),  // P0 -> P1 "1" again: nothing new
        (hint_color(0), false), // P1 -> P0 red: all red, none playable
        (hint_color(1), true),  // P0 -> P1 yellow: Y1 playable, its color new (Y5 touched too)
        (hint_color(0), false), // P1 -> P0 red again
        (hint_color(0), true),  // P0 -> P1 red: the R1s' color is new
    ] {
        let id = Action::Id(mv.uid(plain.config()));
        let (a, b) = (plain.step(std::slice::from_ref(&id)).unwrap(), shaped.step(&[id]).unwrap());
        let bonus = if paid { 0.5 } else { 0.0 };
        assert_eq!(b, a.iter().map(|x| x + bonus).collect::<Vec<_>>(), "{mv:?}");
    }
    assert_eq!(plain.metrics(), shaped.metrics(), "metrics, score included, are the game's");
    assert_eq!(shaped.returns(), vec![1.5, 1.5]);

    // One colour: a colour hint tells nothing, a rank hint on the playable 1 does.
    let mut one = hanabi_dealt(json!({"variant": "very_small", "hint_reward": 0.5}), &[r(1), r(2), r(0), r(3)]);
    let step = |env: &mut HanabiEnv, mv: Move| env.step(&[Action::Id(mv.uid(env.config()))]).unwrap()[0];
    assert_eq!(step(&mut one, hint_color(0)), 0.0, "P0 -> P1 red");
    assert_eq!(step(&mut one, hint_rank(1)), 0.0, "P1 -> P0 \"2\": not playable");
    assert_eq!(step(&mut one, hint_rank(0)), 0.5, "P0 -> P1 \"1\"");

    let err = Registry::with_builtins()
        .make_from_spec(&json!({"name": "hanabi", "hint_reward": -0.5}))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("hint_reward") && err.contains("-0.5"), "{err}");
}

#[test]
fn hanabi_playable_notes_mark_known_safe_plays_and_playable_hinted_cards() {
    let r = |rank| Card::new(0, rank);
    let params = |notes: bool| json!({"variant": "very_small", "observation": "compact", "playable_notes": notes});
    // Player 0: R2 R3; player 1: R1 R4.
    let front = [r(1), r(2), r(0), r(3)];
    let texts = |env: &HanabiEnv| -> Vec<String> {
        let seat = env.acting_seats()[0];
        env.legal_actions(seat).unwrap().into_iter().map(|a| a.text).collect()
    };
    let (mut plain, mut noted) = (hanabi_dealt(params(false), &front), hanabi_dealt(params(true), &front));
    assert!(texts(&plain).contains(&"hint 1 [R1]".to_string()), "{:?}", texts(&plain));
    assert!(texts(&noted).contains(&"hint 1 [R1 playable]".to_string()), "{:?}", texts(&noted));
    assert!(texts(&noted).contains(&"hint 4 [R4]".to_string()), "an unplayable card has no note");
    let hint_one = Action::Id(Move::RevealRank { offset: 1, rank: 0 }.uid(plain.config()));
    plain.step(std::slice::from_ref(&hint_one)).unwrap();
    noted.step(&[hint_one]).unwrap();
    // Player 1 now knows its first card is a 1, and with one colour and no 1 played it is safe.
    assert!(texts(&plain).contains(&"play 1 [?1]".to_string()), "{:?}", texts(&plain));
    assert!(texts(&noted).contains(&"play 1 [?1 playable]".to_string()), "{:?}", texts(&noted));
    assert!(texts(&noted).contains(&"play 2 [??(2345)]".to_string()), "{:?}", texts(&noted));
    assert!(texts(&noted).iter().any(|t| t.starts_with("discard 1 [?1]")), "discards carry no note");
    // The notes are ignored by the parser, and the observation text is the same.
    assert_eq!(noted.parse_action(1, "play 1 [?1 playable]").unwrap(), plain.parse_action(1, "play 1").unwrap());
    assert_eq!(noted.observation(1), plain.observation(1));

    let err = Registry::with_builtins()
        .make_from_spec(&json!({"name": "hanabi", "playable_notes": true}))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("playable_notes") && err.contains("compact"), "{err}");
}
