//! The SmolLM2 game configs (`configs/hanabi_smollm2.yaml`, `configs/hanabi_very_small_smollm2.yaml`,
//! its self-play part 2, `configs/hanabi_very_small_smollm2_selfplay.yaml`, and part 3 on full
//! Hanabi, `configs/hanabi_smollm2_part3.yaml`) load as shipped, on the CPU and for
//! `--device cuda`, and one iteration of each trains and evaluates with the tiny Llama GGUF
//! fixture standing in for SmolLM2 (same family, a chat template in its metadata; no download),
//! part 2 starting from part 1's agents and part 3 from part 2's.

use crate::common;

use std::path::Path;

use troupe::rl::config::TrainConfig;
use troupe::rl::run::TrainingRun;
use troupe_envs::Registry;

const CONFIGS: [&str; 4] = [
    "configs/hanabi_smollm2.yaml",
    "configs/hanabi_very_small_smollm2.yaml",
    "configs/hanabi_very_small_smollm2_selfplay.yaml",
    "configs/hanabi_smollm2_part3.yaml",
];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn the_configs_load_for_the_cpu_and_for_cuda() {
    let registry = Registry::with_builtins();
    for name in CONFIGS {
        let path = root().join(name);
        let config = TrainConfig::from_yaml_file(&path, &[], &registry).unwrap();
        assert_eq!(config.model.device, "cpu", "{name}");
        assert!(config.model.path.as_ref().unwrap().ends_with("SmolLM2-135M-Instruct.Q4_1.gguf"), "{name}");
        assert!(config.action.chat_template, "{name}");
        config.build_env(&path, &registry).unwrap();
        if name.ends_with("_selfplay.yaml") {
            let part_one = TrainConfig::from_yaml_file(&root().join(CONFIGS[1]), &[], &registry).unwrap();
            assert_eq!(config.agents.init_adapters.as_ref(), Some(&part_one.run.out_dir), "part 2 reads part 1's run");
            assert!(config.training.partners.is_empty(), "part 2 is self-play");
        }
        if name.ends_with("_part3.yaml") {
            let part_two = TrainConfig::from_yaml_file(&root().join(CONFIGS[2]), &[], &registry).unwrap();
            assert_eq!(config.agents.init_adapters.as_ref(), Some(&part_two.run.out_dir), "part 3 reads part 2's run");
            assert!(config.training.partners.is_empty(), "part 3 is self-play");
            assert_eq!(config.env.params["variant"], "full", "part 3 plays the full game");
        }
        // For `--device cuda` the config is valid as it stands: a build without the `cuda`
        // feature refuses the device and nothing else.
        let cuda = TrainConfig::from_yaml_file(&path, &["model.device=cuda".to_string()], &registry);
        if cfg!(feature = "cuda") {
            assert_eq!(cuda.unwrap().model.device, "cuda", "{name}");
        } else {
            let err = cuda.unwrap_err().to_string();
            assert!(err.contains("model.device") && err.contains("--features cuda"), "{name}: {err}");
        }
    }
}

#[test]
fn one_iteration_of_each_config_runs_on_the_tiny_stand_in() {
    let registry = Registry::with_builtins();
    let model = root().join("fixtures/gguf/tiny-llama.gguf");
    let dir = tempfile::tempdir().unwrap();
    for name in CONFIGS {
        let out = dir.path().join(name.trim_start_matches("configs/").trim_end_matches(".yaml"));
        let overrides: Vec<String> = [
            format!("model.path={}", model.display()),
            format!("run.out_dir={}", out.display()),
            "run.iterations=1".to_string(),
            "run.checkpoint_every=1".to_string(),
            "training.groups_per_iteration=2".to_string(), // the very_small config seats two partner seatings
            "training.group_size=2".to_string(),
            "training.max_episode_steps=6".to_string(),
            "eval.every=0".to_string(),
            // The fixture's 512 positions: the observation without the move history.
            "env.history_moves=0".to_string(),
        ]
        .to_vec();
        let mut overrides = overrides;
        if name.ends_with("hanabi_smollm2.yaml") || name.ends_with("_part3.yaml") {
            // Full Hanabi's longer observation: hands of 3 keep it within the fixture's positions.
            overrides.push("env.hand_size=3".to_string());
        }
        if name.ends_with("_selfplay.yaml") {
            // Part 2 goes on from part 1's agents (run just before it in this loop).
            let part_one = dir.path().join("hanabi_very_small_smollm2");
            overrides.push(format!("agents.init_adapters={}", part_one.display()));
        }
        if name.ends_with("_part3.yaml") {
            // Part 3 goes on from part 2's agents, on the full game.
            let part_two = dir.path().join("hanabi_very_small_smollm2_selfplay");
            overrides.push(format!("agents.init_adapters={}", part_two.display()));
        }
        let path = root().join(name);
        let config = TrainConfig::from_yaml_file(&path, &overrides, &registry).unwrap();
        let mut run = TrainingRun::start(config, &path, Registry::with_builtins(), &common::test_device()).unwrap();
        let metrics = run.run_iteration().unwrap();
        assert!(run.finished(), "{name}");
        let line = serde_json::to_value(&metrics).unwrap();
        assert!(line["loss"].as_f64().unwrap().is_finite(), "{name}: {line}");
        assert_eq!(line["invalid_rate"].as_f64().unwrap(), 0.0, "{name}: choice mode is never invalid");
        let summary = run.held_out_eval().unwrap();
        assert!(summary.mean_steps >= 1.0, "{name}");
        assert_eq!(summary.invalid_rate, 0.0, "{name}");
    }
}
