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

/// A shipped config, the config whose run it starts from (`agents.init_adapters`; the recipe's
/// parts run in this order) and whether it plays full Hanabi.
struct Part {
    config: &'static str,
    starts_from: Option<&'static str>,
    full_game: bool,
}

const CONFIGS: [Part; 4] = [
    Part { config: "configs/hanabi_smollm2.yaml", starts_from: None, full_game: true },
    Part { config: "configs/hanabi_very_small_smollm2.yaml", starts_from: None, full_game: false },
    Part {
        config: "configs/hanabi_very_small_smollm2_selfplay.yaml",
        starts_from: Some("configs/hanabi_very_small_smollm2.yaml"),
        full_game: false,
    },
    Part {
        config: "configs/hanabi_smollm2_part3.yaml",
        starts_from: Some("configs/hanabi_very_small_smollm2_selfplay.yaml"),
        full_game: true,
    },
];

/// The name a config's run gets in the one-iteration test's temporary directory.
fn run_name(config: &str) -> &str {
    config.trim_start_matches("configs/").trim_end_matches(".yaml")
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn the_configs_load_for_the_cpu_and_for_cuda() {
    let registry = Registry::with_builtins();
    for part in &CONFIGS {
        let name = part.config;
        let path = root().join(name);
        let config = TrainConfig::from_yaml_file(&path, &[], &registry).unwrap();
        assert_eq!(config.model.device, "cpu", "{name}");
        assert!(config.model.path.as_ref().unwrap().ends_with("SmolLM2-135M-Instruct.Q4_1.gguf"), "{name}");
        assert!(config.action.chat_template, "{name}");
        // Hanabi's variant is `full` unless the config names another.
        let variant = config.env.params.get("variant").and_then(|v| v.as_str()).unwrap_or("full");
        assert_eq!(variant == "full", part.full_game, "{name}: env.variant {variant}");
        config.build_env(&path, &registry).unwrap();
        if let Some(before) = part.starts_from {
            let before = TrainConfig::from_yaml_file(&root().join(before), &[], &registry).unwrap();
            assert_eq!(config.agents.init_adapters.as_ref(), Some(&before.run.out_dir), "{name} reads its part's run");
            assert!(config.training.partners.is_empty(), "{name} is self-play");
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
    for part in &CONFIGS {
        let name = part.config;
        let out = dir.path().join(run_name(name));
        let mut overrides: Vec<String> = vec![
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
        ];
        if part.full_game {
            // Full Hanabi's longer observation: hands of 3 keep it within the fixture's positions.
            overrides.push("env.hand_size=3".to_string());
        }
        if let Some(before) = part.starts_from {
            // The part goes on from the agents of the part before it (run earlier in this loop).
            overrides.push(format!("agents.init_adapters={}", dir.path().join(run_name(before)).display()));
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
