//! The external-environment protocol (envs/README.md): troupe's own games served by
//! `troupe env serve` give the same episodes as in process, move by move and through whole
//! rollouts of the model; and a process that crashes, hangs, prints garbage or answers out of
//! turn fails with an error naming it and the offending message, within its time limit.

use std::time::{Duration, Instant};

use burn::tensor::Device;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use troupe::adapters::{AdapterConfig, MultiAdapterManager};
use troupe::generate::choice::ChoiceScore;
use troupe::generate::SamplingConfig;
use troupe::model::{Model, Preset};
use troupe::rl::rollout::{run_episodes, ActionMode, Fallback, RolloutConfig};
use troupe_envs::batch::{reset_all, step_all};
use troupe_envs::{Action, Environment, Registry};

const TROUPE: &str = env!("CARGO_BIN_EXE_troupe");

/// `env: {name: external, command: [troupe, env, serve, NAME], params: ...}`.
fn served(name: &str, params: Value) -> Value {
    json!({"command": [TROUPE, "env", "serve", name], "params": params})
}

/// Everything an observer can ask an environment, for comparing two of them.
fn snapshot(env: &dyn Environment) -> String {
    let seats = 0..env.num_seats();
    format!(
        "{} {} terminal={} acting={:?} returns={:?} metrics={:?} instructions={:?} observations={:?} legal={:?}",
        env.name(),
        env.num_seats(),
        env.is_terminal(),
        env.acting_seats(),
        env.returns(),
        env.metrics(),
        seats.clone().map(|s| env.instructions(s)).collect::<Vec<_>>(),
        seats.clone().map(|s| env.observation(s)).collect::<Vec<_>>(),
        seats.map(|s| env.legal_actions(s)).collect::<Vec<_>>(),
    )
}

#[test]
fn served_games_play_move_by_move_as_in_process() {
    let registry = Registry::with_builtins();
    for (name, params) in [("hanabi", json!({"players": 2})), ("hanabi", json!({"players": 3, "observation": "compact"})), ("bridge", json!({}))] {
        let mut local: Vec<Box<dyn Environment>> = (0..6).map(|_| registry.make(name, &params).unwrap()).collect();
        let mut remote: Vec<Box<dyn Environment>> = (0..6).map(|_| registry.make("external", &served(name, params.clone())).unwrap()).collect();
        let seeds: Vec<u64> = (0..6).map(|i| 1000 + i).collect();
        for (env, &seed) in local.iter_mut().zip(&seeds) {
            env.reset(seed);
        }
        reset_all(&mut remote, &seeds).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut moves = 0;
        loop {
            let mut steps = Vec::new();
            for (i, (l, r)) in local.iter().zip(&remote).enumerate() {
                assert_eq!(snapshot(l.as_ref()), snapshot(r.as_ref()), "{name} episode {i} after {moves} moves");
                if l.is_terminal() {
                    continue;
                }
                let actions: Vec<Action> = l
                    .acting_seats()
                    .into_iter()
                    .map(|seat| {
                        let legal = l.legal_action_ids(seat).unwrap();
                        Action::Id(legal[rng.random_range(0..legal.len())])
                    })
                    .collect();
                steps.push((i, actions));
            }
            if steps.is_empty() {
                break;
            }
            let remote_rewards = step_all(&mut remote, &steps);
            for ((i, actions), remote_reward) in steps.iter().zip(remote_rewards) {
                assert_eq!(local[*i].step(actions), remote_reward, "{name} episode {i}");
            }
            moves += 1;
        }
        assert!(moves > 10, "{name}: whole games were played");
        // A served environment reads replies as the in-process one does.
        let reply = local[0].legal_actions(0).unwrap_or_default();
        for env in local.iter_mut().chain(remote.iter_mut()) {
            env.reset(5);
        }
        let seat = local[0].acting_seats()[0];
        let text = local[0].legal_actions(seat).unwrap()[0].text.clone();
        assert_eq!(local[0].parse_action(seat, &text), remote[0].parse_action(seat, &text));
        let bad = local[0].parse_action(seat, "juggle").unwrap_err().to_string();
        let served_bad = remote[0].parse_action(seat, "juggle").unwrap_err().to_string();
        assert!(served_bad.contains("juggle"), "{served_bad} (in process: {bad}, {reply:?})");
    }
}

#[test]
fn rollouts_through_the_protocol_equal_rollouts_in_process() {
    let device = Device::flex();
    let model = Model::builtin(Preset::Tiny, 0, &device).unwrap();
    let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
    manager.create_adapters(2, &AdapterConfig::default()).unwrap();
    let registry = Registry::with_builtins();
    let config = RolloutConfig {
        mode: ActionMode::Choice,
        invalid_penalty: 0.0,
        fallback: Fallback::Random,
        max_retries: 0,
        max_new_tokens: 8,
        sampling: SamplingConfig { temperature: 1.0, top_k: 0, top_p: 1.0 },
        chat_template: false,
        max_episode_steps: 12,
        choice_score: ChoiceScore::Mean,
    };
    let params = json!({"players": 2, "observation": "compact", "history_moves": 1});
    let seeds = [11, 11, 12, 12];
    let play = |envs: &mut Vec<Box<dyn Environment>>| {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let records = run_episodes(&model, &manager, envs, &seeds, &[0, 1], &config, &mut rng).unwrap();
        format!("{records:?}")
    };
    let mut local: Vec<Box<dyn Environment>> = seeds.iter().map(|_| registry.make("hanabi", &params).unwrap()).collect();
    let mut remote: Vec<Box<dyn Environment>> =
        seeds.iter().map(|_| registry.make("external", &served("hanabi", params.clone())).unwrap()).collect();
    let (a, b) = (play(&mut local), play(&mut remote));
    assert!(a.contains("score"));
    assert_eq!(a, b, "the episodes differ");
}

/// An external environment whose process is `sh -c SCRIPT`, with a short time limit.
fn scripted(script: &str) -> Result<Box<dyn Environment>, String> {
    let registry = Registry::with_builtins();
    registry
        .make("external", &json!({"command": ["sh", "-c", script], "timeout_s": 1.0}))
        .map_err(|e| e.to_string())
}

const HELLO: &str = r#"read l; echo '{"id":0,"result":{"name":"toy","num_seats":1}}'"#;
const STATE: &str = r#"{"acting_seats":[0],"terminal":false,"instructions":["i"],"observations":["o"],"legal_actions":[[{"id":0,"text":"go"}]],"returns":[0.0],"metrics":{"score":0.0}}"#;

#[test]
fn a_faulty_process_fails_clearly_and_never_hangs() {
    let started = Instant::now();
    let err = scripted("echo 'toy starting' >&2; exit 3").err().unwrap();
    assert!(err.contains("sh -c") && err.contains("exited") && err.contains("3") && err.contains("toy starting"), "{err}");

    let err = scripted("sleep 30").err().unwrap();
    assert!(err.contains("no answer to `init` within 1.0 s"), "{err}");

    let err = scripted("read l; echo 'Loading model...'").err().unwrap();
    assert!(err.contains("not a JSON object: Loading model..."), "{err}");

    let err = scripted(r#"read l; echo '{"id":7,"result":{}}'"#).err().unwrap();
    assert!(err.contains("answered request 0 (`init`) with id 7"), "{err}");

    let err = scripted(r#"read l; echo '{"id":0,"error":"no such board"}'"#).err().unwrap();
    assert!(err.contains("refused `init`: no such board"), "{err}");

    let err = scripted(r#"read l; echo '{"id":0,"result":{"name":"toy"}}'"#).err().unwrap();
    assert!(err.contains("num_seats"), "{err}");

    // A state that breaks the contract.
    let bad_state = STATE.replace(r#""returns":[0.0],"#, "");
    let mut env = scripted(&format!("{HELLO}; read l; echo '{{\"id\":1,\"result\":{{\"states\":[{bad_state}]}}}}'; sleep 5")).unwrap();
    let err = reset_all(std::slice::from_mut(&mut env), &[1]).unwrap_err().to_string();
    assert!(err.contains("answered `reset` wrongly") && err.contains("returns"), "{err}");

    // A crash in the middle of an episode.
    let mut env = scripted(&format!("{HELLO}; read l; echo '{{\"id\":1,\"result\":{{\"states\":[{STATE}]}}}}'; read l; echo 'Segmentation fault' >&2; exit 139")).unwrap();
    reset_all(std::slice::from_mut(&mut env), &[1]).unwrap();
    assert_eq!(env.observation(0), "o");
    let err = env.step(&[Action::Id(0)]).unwrap_err().to_string();
    assert!(err.contains("exited") && err.contains("before answering `step`") && err.contains("Segmentation fault"), "{err}");
    assert!(env.is_terminal());
    assert_eq!(env.step(&[Action::Id(0)]).unwrap_err().to_string(), err, "a broken process stays broken");

    // An action the state did not list is refused before it is sent.
    let mut env = scripted(&format!("{HELLO}; read l; echo '{{\"id\":1,\"result\":{{\"states\":[{STATE}]}}}}'; sleep 5")).unwrap();
    env.reset(1);
    let err = env.step(&[Action::Id(4)]).unwrap_err().to_string();
    assert!(err.contains("not a legal action of seat 0"), "{err}");

    // A parse answer naming an action that is not legal.
    let mut env = scripted(&format!(
        "{HELLO}; read l; echo '{{\"id\":1,\"result\":{{\"states\":[{STATE}]}}}}'; read l; echo '{{\"id\":2,\"result\":{{\"results\":[{{\"action\":{{\"id\":9}}}}]}}}}'; sleep 5"
    ))
    .unwrap();
    env.reset(1);
    let err = env.parse_action(0, "go").unwrap_err().to_string();
    assert!(err.contains("not a legal action of seat 0"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(20), "every fault ended within its time limit");

    let registry = Registry::with_builtins();
    let err = registry.make("external", &json!({"command": []})).err().unwrap().to_string();
    assert!(err.contains("command"), "{err}");
    let err = registry.make("external", &json!({"command": ["/no/such/program"]})).err().unwrap().to_string();
    assert!(err.contains("/no/such/program"), "{err}");
    let err = registry.make("external", &json!({"command": ["sh"], "timeout_s": -1})).err().unwrap().to_string();
    assert!(err.contains("timeout_s"), "{err}");
}
