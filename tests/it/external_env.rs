//! The external-environment protocol (envs/README.md): troupe's own games served by
//! `troupe env serve` give the same episodes as in process, move by move and through whole
//! rollouts of the model; and a process that crashes, hangs, prints garbage or answers out of
//! turn fails with an error naming it and the offending message, within its time limit.

use crate::common;
use common::{gone, wait_gone};

use std::time::{Duration, Instant};
use troupe::error::RunError;

use burn::tensor::Device;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use troupe::adapters::{AdapterConfig, MultiAdapterManager};
use troupe::generate::choice::ChoiceScore;
use troupe::model::{Model, Preset};
use troupe::rl::rollout::{episode_rngs, run_episodes, ActionConfig, ActionMode, Fallback, RolloutConfig};
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
    for (name, params) in [
        ("hanabi", json!({"players": 2})),
        ("hanabi", json!({"players": 3, "observation": "compact"})),
        ("bridge", json!({})),
    ] {
        let mut local: Vec<Box<dyn Environment>> = (0..6).map(|_| registry.make(name, &params).unwrap()).collect();
        let mut remote: Vec<Box<dyn Environment>> =
            (0..6).map(|_| registry.make("external", &served(name, params.clone())).unwrap()).collect();
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

/// `choice`-mode rollout settings for the tiny model, episodes cut after `max_episode_steps`.
fn choice_rollout(max_episode_steps: usize) -> RolloutConfig {
    RolloutConfig {
        action: ActionConfig {
            mode: ActionMode::Choice,
            invalid_penalty: 0.0,
            fallback: Fallback::Random,
            max_retries: 0,
            max_new_tokens: 8,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            chat_template: false,
            choice_score: ChoiceScore::Mean,
        },
        max_episode_steps,
    }
}

#[test]
fn rollouts_through_the_protocol_equal_rollouts_in_process() {
    let device = Device::flex();
    let model = Model::builtin(Preset::Tiny, 0, &device).unwrap();
    let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
    manager.create_adapters(2, &AdapterConfig::default()).unwrap();
    let registry = Registry::with_builtins();
    let config = choice_rollout(12);
    let params = json!({"players": 2, "observation": "compact", "history_moves": 1});
    let seeds = [11, 11, 12, 12];
    let play = |envs: &mut Vec<Box<dyn Environment>>| {
        let mut rngs = episode_rngs(9, 0, seeds.len());
        let records = run_episodes(&model, &manager, envs, &seeds, &[0, 1], &config, &mut rngs).unwrap();
        format!("{records:?}")
    };
    let mut local: Vec<Box<dyn Environment>> =
        seeds.iter().map(|_| registry.make("hanabi", &params).unwrap()).collect();
    let mut remote: Vec<Box<dyn Environment>> =
        seeds.iter().map(|_| registry.make("external", &served("hanabi", params.clone())).unwrap()).collect();
    let (a, b) = (play(&mut local), play(&mut remote));
    assert!(a.contains("score"));
    assert_eq!(a, b, "the episodes differ");
}

/// An external environment whose process is `sh -c SCRIPT`, with a short time limit.
fn scripted(script: &str) -> Result<Box<dyn Environment>, String> {
    let registry = Registry::with_builtins();
    registry.make("external", &json!({"command": ["sh", "-c", script], "timeout_s": 1.0})).map_err(|e| e.to_string())
}

const HELLO: &str = r#"read l; echo '{"id":0,"result":{"name":"toy","num_seats":1}}'"#;
const STATE: &str = r#"{"acting_seats":[0],"terminal":false,"instructions":["i"],"observations":["o"],"legal_actions":[[{"id":0,"text":"go"}]],"returns":[0.0],"metrics":{"score":0.0}}"#;

#[test]
fn a_faulty_process_fails_clearly_and_never_hangs() {
    let started = Instant::now();
    let err = scripted("echo 'toy starting' >&2; exit 3").err().unwrap();
    assert!(
        err.contains("sh -c") && err.contains("exited") && err.contains("3") && err.contains("toy starting"),
        "{err}"
    );

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
    let mut env =
        scripted(&format!("{HELLO}; read l; echo '{{\"id\":1,\"result\":{{\"states\":[{bad_state}]}}}}'; sleep 5"))
            .unwrap();
    let err = reset_all(std::slice::from_mut(&mut env), &[1]).unwrap_err().to_string();
    assert!(err.contains("answered `reset` wrongly") && err.contains("returns"), "{err}");

    // A crash in the middle of an episode.
    let mut env = scripted(&format!("{HELLO}; read l; echo '{{\"id\":1,\"result\":{{\"states\":[{STATE}]}}}}'; read l; echo 'Segmentation fault' >&2; exit 139")).unwrap();
    reset_all(std::slice::from_mut(&mut env), &[1]).unwrap();
    assert_eq!(env.observation(0), "o");
    let err = env.step(&[Action::Id(0)]).unwrap_err().to_string();
    assert!(
        err.contains("exited") && err.contains("before answering `step`") && err.contains("Segmentation fault"),
        "{err}"
    );
    assert!(env.is_terminal());
    assert_eq!(env.step(&[Action::Id(0)]).unwrap_err().to_string(), err, "a broken process stays broken");

    // An action the state did not list is refused before it is sent.
    let mut env =
        scripted(&format!("{HELLO}; read l; echo '{{\"id\":1,\"result\":{{\"states\":[{STATE}]}}}}'; sleep 5"))
            .unwrap();
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

/// A Python environment (the Nim game of python/troupe_env.py's docstring) whose process dies
/// at its next step once `marker` exists.
fn crashing_nim(dir: &std::path::Path, marker: &std::path::Path) -> std::path::PathBuf {
    let module_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let script = dir.join("nim.py");
    let source = format!(
        r#"import os, random, sys
sys.path.insert(0, {module_dir:?})
from troupe_env import Environment, serve

class Nim(Environment):
    name = "nim"
    num_seats = 2
    def reset(self, seed):
        self.stones, self.turn = random.Random(seed).randint(5, 9), 0
    def acting_seats(self):
        return [self.turn]
    def instructions(self, seat):
        return "Take 1 to 3 stones in turn; whoever takes the last stone wins."
    def observation(self, seat):
        return f"{{self.stones}} stones"
    def legal_actions(self, seat):
        return [(n, f"take {{n}}") for n in range(1, min(3, self.stones) + 1)]
    def step(self, actions):
        if os.path.exists({marker:?}):
            print("nim: the marker says crash", file=sys.stderr, flush=True)
            os._exit(7)
        self.stones -= actions[0]
        if self.stones == 0:
            return [1.0, -1.0] if self.turn == 0 else [-1.0, 1.0]
        self.turn = 1 - self.turn
        return [0.0, 0.0]
    def is_terminal(self):
        return self.stones == 0

serve(lambda params: Nim())
"#,
        module_dir = module_dir.display().to_string(),
        marker = marker.display().to_string(),
    );
    std::fs::write(&script, source).unwrap();
    script
}

/// The processes whose command line mentions `needle`.
fn processes_running(needle: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
        .filter(|cmdline| String::from_utf8_lossy(cmdline).contains(needle))
        .count()
}

#[test]
fn a_run_whose_environment_crashes_stops_clearly_and_resumes_from_its_last_checkpoint() {
    use troupe::rl::config::TrainConfig;
    use troupe::rl::run::TrainingRun;

    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("crash-now");
    let script = crashing_nim(dir.path(), &marker);
    let run_dir = dir.path().join("run");
    let yaml = format!(
        "run: {{out_dir: {run}, seed: 3, iterations: 3, checkpoint_every: 1}}\n\
         env: {{name: external, command: [python3, {script}], timeout_s: 20}}\n\
         adapter: {{r: 4, lora_alpha: 8.0}}\n\
         action: {{mode: choice, chat_template: false}}\n\
         training: {{group_size: 2, groups_per_iteration: 2, lr: 1.0e-2, max_episode_steps: 12}}\n\
         eval: {{episodes: 8}}\n",
        run = run_dir.display(),
        script = script.display()
    );
    let registry = Registry::with_builtins();
    let origin = std::path::Path::new("nim.yaml");
    let config = TrainConfig::from_yaml_str(&yaml, origin, &[], &registry).unwrap();
    let device = Device::flex();
    let mut run = TrainingRun::start(config, origin, registry.clone(), &device).unwrap();
    run.run_iteration().unwrap();
    std::fs::write(&marker, "").unwrap();
    let err = format!("{:#}", run.run_iteration().unwrap_err());
    assert!(err.contains("nim.py") && err.contains("exited") && err.contains("the marker says crash"), "{err}");
    drop(run);
    drop(registry);
    let script_name = script.display().to_string();
    assert_eq!(processes_running(&script_name), 0, "the environment process outlived the run");

    std::fs::remove_file(&marker).unwrap();
    // Another test of this binary may have forked a child while `run` held the lock: the copy of
    // the lock's descriptor lives until that child execs (moments, or longer on a loaded
    // machine), so a refusal naming this very process is retried briefly.
    let mut attempts = 0;
    let mut resumed = loop {
        match TrainingRun::resume(&run_dir, &[], Registry::with_builtins(), &device) {
            Err(troupe::error::TroupeError::Run(RunError::RunInUse { holder, .. }))
                if holder == Some(std::process::id()) && attempts < 50 =>
            {
                attempts += 1;
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            other => break other.unwrap(),
        }
    };
    assert_eq!(resumed.iteration(), 1, "resumed from the checkpoint written before the crash");
    while !resumed.finished() {
        resumed.run_iteration().unwrap();
    }
    assert!(run_dir.join("checkpoints/iteration-000003/adapters").exists());
    drop(resumed);
    assert_eq!(processes_running(&script_name), 0);
}

/// A Python reward function served by python/troupe_reward.py: `body` is the function's body,
/// with `completions_agent0`, `completions_agent1` and `batch_items` in scope.
fn python_reward(dir: &std::path::Path, body: &str) -> Vec<String> {
    let module_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let script = dir.join(format!("reward_{}.py", body.len()));
    let source = format!(
        "import json, sys\nsys.path.insert(0, {module_dir:?})\nfrom troupe_reward import serve_reward\n\n\
         def reward(completions_agent0, completions_agent1, batch_items):\n    {body}\n\nserve_reward(reward)\n",
        module_dir = module_dir.display().to_string()
    );
    std::fs::write(&script, source).unwrap();
    vec!["python3".to_string(), script.display().to_string()]
}

fn pipeline(command: Vec<String>) -> troupe::rl::credit::rewards::RewardPipeline {
    use troupe::rl::credit::rewards::{RewardFunction, RewardPipeline, WeightedReward};
    let external =
        WeightedReward { command, timeout_s: Some(5.0), ..WeightedReward::builtin(RewardFunction::External, 2.0) };
    RewardPipeline::new(vec![WeightedReward::builtin(RewardFunction::EnvReturn, 1.0), external], vec![]).unwrap()
}

fn item(seed: u64, a: &str, b: &str) -> troupe::rl::credit::external_reward::RewardItem {
    troupe::rl::credit::external_reward::RewardItem {
        seed,
        completions: vec![vec![a.to_string()], vec![b.to_string()]],
        prompts: vec![vec!["p0".to_string()], vec!["p1".to_string()]],
        returns: vec![1.0, 1.0],
        metrics: [("score".to_string(), 1.0)].into_iter().collect(),
    }
}

#[test]
fn external_reward_functions_score_batches_and_their_faults_are_named() {
    use troupe::rl::credit::external_reward::ExternalRewards;
    let dir = tempfile::tempdir().unwrap();
    // One number per episode goes to both seats; a list gives one per seat.
    let body = "return [len(a) - len(b) if item['seed'] % 2 else [len(a), len(b)] for a, b, item in zip(completions_agent0, completions_agent1, batch_items)]";
    let rewards = ExternalRewards::start(&pipeline(python_reward(dir.path(), body))).unwrap();
    let values = rewards.score(&[item(1, "abcd", "ab"), item(2, "abc", "a"), item(3, "", "xyz")]).unwrap();
    assert_eq!(values, vec![vec![vec![2.0], vec![2.0]], vec![vec![3.0], vec![1.0]], vec![vec![-3.0], vec![-3.0]]]);

    // The pipeline adds the external value with its weight.
    let p = pipeline(vec!["unused".into()]);
    let metrics = [("score".to_string(), 0.0)].into_iter().collect();
    let outcome = troupe::rl::credit::rewards::SeatOutcome {
        env_return: 1.0,
        invalid_actions: 0,
        metrics: &metrics,
        computed: &[0.25],
    };
    assert_eq!(p.reward(&outcome).unwrap(), 1.5);

    for (body, expected) in [
        ("return [1.0]", "gave 1 rewards for 2 episodes"),
        ("return [float('nan'), 1.0]", "is not a finite number"),
        ("return [[1.0, 2.0, 3.0], 1.0]", "or a list of 2"),
        ("raise KeyError('prompt')", "refused `score`: KeyError: 'prompt'"),
        ("import os; os._exit(4)", "exited"),
        ("import time; time.sleep(30)", "no answer to `score` within 5.0 s"),
    ] {
        let rewards = ExternalRewards::start(&pipeline(python_reward(dir.path(), body))).unwrap();
        let err = rewards.score(&[item(1, "a", "b"), item(2, "c", "d")]).unwrap_err().to_string();
        assert!(err.contains(expected) && err.contains("reward_"), "{body}: {err}");
    }
    let err = troupe::rl::credit::rewards::RewardPipeline::new(
        vec![troupe::rl::credit::rewards::WeightedReward::builtin(
            troupe::rl::credit::rewards::RewardFunction::External,
            1.0,
        )],
        vec![],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("rewards.functions[0].command"), "{err}");
}

#[test]
fn a_training_run_calls_its_external_reward_with_every_episode() {
    use troupe::rl::config::TrainConfig;
    use troupe::rl::run::TrainingRun;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("calls.jsonl");
    let body = format!(
        "open({log:?}, 'a').write(json.dumps([len(batch_items), completions_agent0[0], batch_items[0]['metrics']]) + '\\n'); return [0.5] * len(batch_items)",
        log = log.display().to_string()
    );
    let command = python_reward(dir.path(), &body);
    let yaml = format!(
        "run: {{out_dir: {run}, seed: 3, iterations: 2, checkpoint_every: 1}}\n\
         env: {{name: hanabi, players: 2, observation: compact}}\n\
         adapter: {{r: 4, lora_alpha: 8.0}}\n\
         action: {{mode: choice, chat_template: false}}\n\
         training: {{group_size: 2, groups_per_iteration: 2, lr: 1.0e-2, max_episode_steps: 4}}\n\
         rewards: {{functions: [{{name: env_return}}, {{name: external, command: [{python}, {script}], weight: 1.0}}]}}\n",
        run = dir.path().join("run").display(),
        python = command[0],
        script = command[1],
    );
    let registry = Registry::with_builtins();
    let origin = std::path::Path::new("reward.yaml");
    let config = TrainConfig::from_yaml_str(&yaml, origin, &[], &registry).unwrap();
    let mut run = TrainingRun::start(config, origin, registry, &Device::flex()).unwrap();
    while !run.finished() {
        run.run_iteration().unwrap();
    }
    let calls: Vec<Value> =
        std::fs::read_to_string(&log).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(calls.len(), 2, "one call per iteration: {calls:?}");
    for call in &calls {
        assert_eq!(call[0], 4, "every episode of the iteration in one batch");
        let first_reply = call[1].as_str().unwrap();
        assert!(
            ["play", "discard", "hint", "reveal"].iter().any(|w| first_reply.contains(w)),
            "a Hanabi move: {first_reply}"
        );
        assert!(call[2].get("score").is_some());
    }
}

/// Mean and population std, as troupe's `*_std` metrics are computed.
fn mean_std(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    (mean, (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n).sqrt())
}

#[test]
fn an_external_reward_has_its_own_metrics_in_training_and_in_eval() {
    use troupe::rl::config::TrainConfig;
    use troupe::rl::run::TrainingRun;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("values.jsonl");
    // One value per episode (both seats get it); every call logs the values it gave.
    let body = format!(
        "values = [float(len(a) % 5) - 1.5 + 0.25 * (item['seed'] % 3) for a, item in zip(completions_agent0, batch_items)]; \
         open({log:?}, 'a').write(json.dumps(values) + '\\n'); return values",
        log = log.display().to_string()
    );
    let command = python_reward(dir.path(), &body);
    // Unlabelled, an external function's metrics are named after its script.
    let label = std::path::Path::new(&command[1]).file_stem().unwrap().to_str().unwrap().to_string();
    let config_path = dir.path().join("reward.yaml");
    let yaml = format!(
        "run: {{out_dir: {run}, seed: 3, iterations: 2, checkpoint_every: 1}}\n\
         env: {{name: hanabi, players: 2, observation: compact}}\n\
         adapter: {{r: 4, lora_alpha: 8.0}}\n\
         action: {{mode: choice, chat_template: false}}\n\
         training: {{group_size: 2, groups_per_iteration: 2, lr: 1.0e-2, max_episode_steps: 4}}\n\
         eval: {{every: 2, every_episodes: 3, episodes: 4, seed: 9000, max_episode_steps: 6}}\n\
         rewards: {{functions: [{{name: env_return}}, {{name: external, command: [{python}, {script}], weight: 0.5}}]}}\n",
        run = dir.path().join("run").display(),
        python = command[0],
        script = command[1],
    );
    std::fs::write(&config_path, &yaml).unwrap();
    let registry = Registry::with_builtins();
    let config = TrainConfig::from_yaml_str(&yaml, &config_path, &[], &registry).unwrap();
    let mut run = TrainingRun::start(config, &config_path, registry, &Device::flex()).unwrap();
    while !run.finished() {
        run.run_iteration().unwrap();
    }
    drop(run);

    // `troupe eval` starts the reward process too and reports the function over its episodes.
    let out = std::process::Command::new(TROUPE)
        .args(["eval", "--config", config_path.to_str().unwrap(), "--adapters"])
        .arg(dir.path().join("run"))
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let eval: Value = serde_json::from_slice(&out.stdout).unwrap();

    // The calls, in order: iteration 1, iteration 2, the held-out evaluation after iteration 2
    // (3 episodes), `troupe eval` (4 episodes).
    let calls: Vec<Vec<f64>> =
        std::fs::read_to_string(&log).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(calls.iter().map(Vec::len).collect::<Vec<_>>(), [4, 4, 3, 4], "{calls:?}");
    let lines: Vec<Value> = std::fs::read_to_string(dir.path().join("run/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let close = |a: &Value, b: f64| (a.as_f64().unwrap_or(f64::NAN) - b).abs() < 1e-9;
    for (line, values) in lines.iter().zip(&calls) {
        let (mean, std) = mean_std(values);
        let extra = &line["extra"];
        assert!(close(&extra[format!("rewards/{label}/mean")], mean), "{mean} {extra}");
        assert!(close(&extra[format!("rewards/{label}/std")], std), "{std} {extra}");
        assert!(extra.get("rewards/env_return/mean").is_some(), "every function has its key: {extra}");
    }
    let stderr = |values: &[f64]| {
        let n = values.len() as f64;
        mean_std(values).1 * (n / (n - 1.0)).sqrt() / n.sqrt()
    };
    let held_out = &lines[1]["extra"];
    assert!(close(&held_out[format!("eval_rewards/{label}/mean")], mean_std(&calls[2]).0), "{held_out}");
    assert!(close(&held_out[format!("eval_rewards/{label}/stderr")], stderr(&calls[2])), "{held_out}");
    assert!(lines[0]["extra"].get(format!("eval_rewards/{label}/mean")).is_none(), "no evaluation at iteration 1");
    let reported = &eval["rewards"][&label];
    assert!(close(&reported["mean"], mean_std(&calls[3]).0), "{eval}");
    assert!(close(&reported["stderr"], stderr(&calls[3])), "{eval}");
    assert!(eval["rewards"].get("env_return").is_some(), "{eval}");

    // TensorBoard and W&B get the same keys (TRL's names).
    let line: troupe::rl::run::metrics::IterationMetrics = serde_json::from_value(lines[1].clone()).unwrap();
    let scalars: std::collections::BTreeMap<String, f64> =
        troupe::rl::run::tracking::trl_scalars(&line).into_iter().collect();
    assert_eq!(scalars[&format!("rewards/{label}/mean")], line.extra[&format!("rewards/{label}/mean")]);
    assert!(scalars.contains_key(&format!("eval/rewards/{label}/stderr")), "{scalars:?}");
}

#[test]
fn an_environment_that_refuses_its_own_legal_action_stops_the_rollout_with_a_named_error() {
    let device = Device::flex();
    let model = Model::builtin(Preset::Tiny, 0, &device).unwrap();
    let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
    manager.create_adapters(1, &AdapterConfig::default()).unwrap();
    let script = format!(
        "{HELLO}; read l; echo '{{\"id\":1,\"result\":{{\"states\":[{STATE}]}}}}'; read l; \
         echo '{{\"id\":2,\"result\":{{\"results\":[{{\"error\":\"the table is closed\"}}]}}}}'; sleep 5"
    );
    let mut envs = vec![scripted(&script).unwrap()];
    let config = choice_rollout(4);
    let mut rngs = episode_rngs(0, 0, 1);
    let err = run_episodes(&model, &manager, &mut envs, &[42], &[0], &config, &mut rngs).unwrap_err().to_string();
    assert!(
        err.contains(
            "toy: refused an action at step 0 of the episode with seed 42: illegal action \"go\" (action 0): the table is closed"
        ),
        "{err}"
    );
    assert_eq!(err.matches("action 0").count(), 1, "the action is named once: {err}");
}

/// An external environment `sh -c SCRIPT` with extra parameters.
fn scripted_with(script: &str, extra: Value) -> Result<Box<dyn Environment>, String> {
    let mut params = json!({"command": ["sh", "-c", script], "timeout_s": 5.0});
    params.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    Registry::with_builtins().make("external", &params).map_err(|e| e.to_string())
}

#[test]
fn oversized_unreadable_and_impossible_answers_are_refused_by_name() {
    let err = scripted_with(r#"read l; echo '{"id":0,"result":{"name":"toy","num_seats":1000000000000}}'"#, json!({}))
        .err()
        .unwrap();
    assert!(err.contains("num_seats 1000000000000 (1 to 4096)"), "{err}");

    // A line beyond `max_line_bytes` stops the exchange before the rest of it is read.
    let script = r#"read l; head -c 100000 /dev/zero | tr '\0' 'x'; echo"#;
    let err = scripted_with(script, json!({"max_line_bytes": 1000})).err().unwrap();
    assert!(err.contains("longer than 1000 bytes (`max_line_bytes`)") && err.contains("`init`"), "{err}");
    let err = Registry::with_builtins()
        .make("external", &json!({"command": ["sh"], "max_line_bytes": 0}))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("max_line_bytes"), "{err}");

    let err = scripted_with(r#"read l; printf '{"id":0,\377}\n'"#, json!({})).err().unwrap();
    assert!(err.contains("not UTF-8") && !err.contains("stdout closed"), "{err}");
}

#[test]
fn what_an_environment_starts_in_its_group_ends_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("helper.pid");
    let script = format!(
        r#"sleep 1000 & echo $! > {}; {HELLO}; read l; echo '{{"id":1,"result":{{"states":[{STATE}]}}}}'; read l; sleep 1000"#,
        pid_file.display()
    );
    let helper =
        |pid_file: &std::path::Path| -> u32 { std::fs::read_to_string(pid_file).unwrap().trim().parse().unwrap() };

    // A normal end: the registry (and its process) dropped.
    let env = scripted_with(&script, json!({})).unwrap();
    let pid = helper(&pid_file);
    assert!(!gone(pid));
    drop(env);
    assert!(wait_gone(pid), "the helper outlived its environment's end");

    // A kill over a timeout.
    std::fs::remove_file(&pid_file).unwrap();
    let mut env = scripted_with(&script, json!({"timeout_s": 0.5})).unwrap();
    let pid = helper(&pid_file);
    reset_all(std::slice::from_mut(&mut env), &[1]).unwrap();
    let err = env.step(&[Action::Id(0)]).unwrap_err().to_string();
    assert!(err.contains("no answer to `step`"), "{err}");
    assert!(wait_gone(pid), "the helper outlived a timeout kill");
}

#[test]
#[cfg(target_os = "linux")]
fn a_descendant_that_left_the_group_ends_with_its_environment() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("daemon.pid");
    // The environment's child moves to a session of its own (`setsid`) and forks the daemon,
    // which the group kill cannot reach; then the child exits, orphaning it.
    let daemon = format!(
        r#"python3 -c 'import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        open("{pid}.tmp", "w").write(str(os.getpid())); os.rename("{pid}.tmp", "{pid}"); time.sleep(1000)
    os._exit(0)
os.wait()'"#,
        pid = pid_file.display()
    );
    let script =
        format!(r#"{daemon}; {HELLO}; read l; echo '{{"id":1,"result":{{"states":[{STATE}]}}}}'; read l; sleep 1000"#);
    let daemon_pid = |pid_file: &std::path::Path| -> u32 {
        let started = Instant::now();
        loop {
            if let Some(pid) = std::fs::read_to_string(pid_file).ok().and_then(|t| t.trim().parse().ok()) {
                return pid;
            }
            assert!(started.elapsed() < Duration::from_secs(20), "the daemon never started");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let session = |pid: u32| -> String {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        stat.rsplit(')').next().unwrap().split_whitespace().nth(3).unwrap().to_string()
    };

    // A normal end: the environment dropped.
    let env = scripted_with(&script, json!({})).unwrap();
    let pid = daemon_pid(&pid_file);
    assert!(!gone(pid));
    assert_ne!(session(pid), session(std::process::id()), "the daemon left troupe's session");
    drop(env);
    assert!(wait_gone(pid), "the daemon outlived its environment's end");

    // A kill over a timeout.
    std::fs::remove_file(&pid_file).unwrap();
    let mut env = scripted_with(&script, json!({"timeout_s": 0.5})).unwrap();
    let pid = daemon_pid(&pid_file);
    reset_all(std::slice::from_mut(&mut env), &[1]).unwrap();
    let err = env.step(&[Action::Id(0)]).unwrap_err().to_string();
    assert!(err.contains("no answer to `step`"), "{err}");
    assert!(wait_gone(pid), "the daemon outlived a timeout kill");
    drop(env);
}

#[test]
fn metric_keys_that_change_between_episodes_stop_the_run_by_name() {
    let other = STATE.replace(r#"{"score":0.0}"#, r#"{"score":0.0,"bonus":1.0}"#);
    let script = format!(r#"{HELLO}; read l; echo '{{"id":1,"result":{{"states":[{STATE},{other}]}}}}'; sleep 5"#);
    // Two episodes of one process (one registry, the same parameters), reset in one exchange.
    let registry = Registry::with_builtins();
    let params = json!({"command": ["sh", "-c", script], "timeout_s": 5.0});
    let mut envs = vec![registry.make("external", &params).unwrap(), registry.make("external", &params).unwrap()];
    let err = reset_all(&mut envs, &[7, 8]).unwrap_err().to_string();
    assert!(
        err.contains("(seed 8): `metrics` has the keys [\"bonus\", \"score\"], but the first state had [\"score\"]"),
        "{err}"
    );
    assert!(err.contains("keep the same metric keys"), "{err}");
}

#[test]
fn an_illegal_action_is_named_by_its_text() {
    let refusing = format!(
        r#"{HELLO}; read l; echo '{{"id":1,"result":{{"states":[{STATE}]}}}}'; read l; echo '{{"id":2,"result":{{"results":[{{"error":"the deck is empty"}}]}}}}'; sleep 5"#
    );
    let mut env = scripted_with(&refusing, json!({})).unwrap();
    env.reset(1);
    let err = env.step(&[Action::Id(0)]).unwrap_err().to_string();
    assert!(err.contains("\"go\" (action 0)") && err.contains("the deck is empty"), "{err}");
}
