//! Whole episodes: seeding, observations, baseline policies, benchmarks, recording and
//! replaying, and the interactive loop.

use serde_json::json;
use troupe_envs::hanabi::rule_player::HanabiRulePolicy;
use troupe_envs::policy::RandomPolicy;
use troupe_envs::records::{record_episodes, replay_line};
use troupe_envs::runner::{bench, play_interactive, run_episode};
use troupe_envs::{Environment, Registry};

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
