//! `TrainConfig`: a training run's YAML config (DESIGN.md, "Training"; `configs/*.yaml`).
//!
//! Each section is the config type of the component it configures, used directly, with every
//! default beside its field ([`crate::section`]): `run:` is the run directory's
//! [`RunConfig`], `model:` the model loader's [`LoadOptions`], `adapter:` the adapters' [`AdapterConfig`], `action:` the rollout's
//! [`ActionConfig`], `training:` [`TrainingConfig`] (holding AdamW's
//! [`crate::adapters::AdamWConfig`] as `training.optimizer`, the KL penalty's as `training.kl`,
//! the objective's and the format warm-up's), `rewards:` the credit phase's [`RewardsConfig`],
//! `eval:` the evaluation's [`EvalConfig`]. `troupe train --print-config` prints every key
//! with its default, from these types.
//!
//! Strict: an unknown key or a value of the wrong type is an error naming the file and the key
//! (`configs/hanabi.yaml: training.group_size: invalid type: string "four", expected usize`).
//! `--set a.b=c` overrides are applied to the YAML tree before it is read ([`overrides`]), so
//! they are checked exactly like the file; keys that moved are read at their new place with a
//! warning ([`migrate`]); [`validate`] checks ranges once, before anything is built. The resolved
//! config ([`TrainConfig::to_yaml`]) is what a run directory keeps; [`guard`] holds a resumed run
//! to it.

pub mod file;
pub mod guard;
pub mod migrate;
pub mod overrides;
pub mod preflight;
pub mod sections;
pub mod validate;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_yaml::{Mapping, Value as Yaml};
use troupe_envs::{EnvError, Environment, Registry};

pub use crate::model::LoadOptions;
use overrides::{apply_override, Schema};
pub use sections::{AgentsConfig, EnvConfig, RuntimeConfig, TrainingConfig};

pub use crate::adapters::AdapterConfig;
use crate::error::{Result, TroupeError};
use crate::rl::credit::rewards::RewardPipeline;
pub use crate::rl::credit::rewards::RewardsConfig;
pub use crate::rl::eval::EvalConfig;
pub use crate::rl::rollout::{ActionConfig, ActionMode, Fallback, RolloutConfig};
pub use crate::rl::run::RunConfig;

/// A whole training run: every section of the YAML file.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Where the run writes, how long it lasts, how often it checkpoints.
    pub run: RunConfig,
    /// The base model.
    pub model: LoadOptions,
    /// The environment and its parameters.
    pub env: EnvConfig,
    /// Agents and which seat each plays.
    pub agents: AgentsConfig,
    /// Every agent's LoRA adapter.
    pub adapter: AdapterConfig,
    /// How agents' text becomes actions.
    pub action: ActionConfig,
    /// MAGRPO's hyper-parameters.
    pub training: TrainingConfig,
    /// Reward functions and processors.
    pub rewards: RewardsConfig,
    /// Evaluation on held-out seeds.
    pub eval: EvalConfig,
    /// Speed and memory settings that change no result's maths.
    pub runtime: RuntimeConfig,
}

/// The resolved config's file name inside a run directory.
pub const CONFIG_FILE: &str = "config.yaml";

/// Sections whose keys are free-form (not checked against the schema when overriding).
const FREE_FORM: &[&[&str]] = &[&["env"], &["eval", "baseline_seats"], &["eval", "env"], &["training", "partners"]];

/// The schema `--set` overrides are checked against: the default config's tree.
fn schema() -> Schema {
    Schema {
        defaults: serde_yaml::to_value(TrainConfig::default()).expect("the default config serializes"),
        free_form: FREE_FORM,
    }
}

impl TrainConfig {
    /// Reads `path`, applies the `--set key.path=value` overrides, parses strictly and validates
    /// against the environments and policies of `registry` (see [`TrainConfig::from_yaml_str`]).
    /// A file that holds no config (empty, or only comments) and a section left empty (as a
    /// file cut off after `eval:` leaves it) are errors; a file that does not end with a
    /// newline, as a cut-off one does not, gets a warning.
    pub fn from_yaml_file(path: &Path, overrides: &[String], registry: &Registry) -> Result<Self> {
        let text = file::read_config(path)?;
        file::check_whole(&text, path)?;
        Self::from_yaml_str(&text, path, overrides, registry)
    }

    /// Parses `text` (named `origin` in errors): the YAML tree, then each override in order
    /// (`training.optimizer.lr=3e-4`, `agents.seats=[0, 1, 0, 1]`, `agents.seats[2]=1`; values
    /// are YAML scalars or flow collections), then the typed config, then
    /// [`TrainConfig::validate`].
    pub fn from_yaml_str(text: &str, origin: &Path, overrides: &[String], registry: &Registry) -> Result<Self> {
        let config_error =
            |key: String, message: String| TroupeError::BadValue { origin: Some(origin.to_path_buf()), key, message };
        let mut tree: Yaml = serde_yaml::from_str(text).map_err(|e| config_error(String::new(), e.to_string()))?;
        if tree.is_null() {
            tree = Yaml::Mapping(Mapping::new());
        }
        if !tree.is_mapping() {
            return Err(config_error(
                String::new(),
                "the config must be a mapping of sections (run, model, env, ...)".into(),
            ));
        }
        migrate::move_keys(&mut tree, Some(origin));
        let schema = schema();
        for raw in overrides {
            let raw = migrate::moved_override(raw);
            // A key the schema does not have is the override's fault, not the file's.
            apply_override(&mut tree, &raw, &schema)
                .map_err(|(key, message)| TroupeError::config(PathBuf::from("--set"), key, message))?;
        }
        if let Some((key, value)) = file::non_finite_number(&tree) {
            return Err(config_error(key, format!("{value} is not a finite number")));
        }
        let config: TrainConfig = serde_path_to_error::deserialize(tree).map_err(|err| {
            let key = err.path().to_string();
            let key = if key == "." { String::new() } else { key };
            config_error(key, err.into_inner().to_string())
        })?;
        config.validate(origin, registry)?;
        Ok(config)
    }

    /// Reads the resolved config a run directory keeps (`RUN_DIR/config.yaml`), as
    /// `troupe train --resume RUN_DIR` does, validated like any config file.
    pub fn from_run_dir(run_dir: &Path, registry: &Registry) -> Result<Self> {
        Self::from_yaml_file(&run_dir.join(CONFIG_FILE), &[], registry)
    }

    /// Writes the resolved config to `RUN_DIR/config.yaml` atomically (creating `run_dir`).
    pub fn save(&self, run_dir: &Path) -> Result<PathBuf> {
        std::fs::create_dir_all(run_dir).map_err(|e| TroupeError::io(run_dir, e))?;
        let path = run_dir.join(CONFIG_FILE);
        crate::fsutil::write_atomic(&path, self.to_yaml()?.as_bytes())?;
        Ok(path)
    }

    /// The resolved config as YAML (what a run directory keeps as `config.yaml`, and what
    /// `troupe train --print-config` prints); reading it back gives an equal config.
    pub fn to_yaml(&self) -> Result<String> {
        serde_yaml::to_string(self).map_err(|e| TroupeError::BadValue {
            origin: Some(PathBuf::from("config.yaml")),
            key: String::new(),
            message: e.to_string(),
        })
    }

    /// The adapter configuration every agent gets (the model path recorded for deployment).
    pub fn adapter_config(&self) -> AdapterConfig {
        AdapterConfig {
            base_model_name_or_path: self.model.path.as_ref().map(|p| p.display().to_string()),
            ..self.adapter.clone()
        }
    }

    /// The environment spec of evaluation: `env:` with `eval.env`'s parameters over it.
    pub fn eval_env_spec(&self) -> serde_json::Value {
        let mut spec = self.env.spec();
        if let serde_json::Value::Object(object) = &mut spec {
            for (key, value) in &self.eval.env {
                object.insert(key.clone(), value.clone());
            }
        }
        spec
    }

    /// The rollout settings of evaluation: `action:`, whole episodes (or
    /// `eval.max_episode_steps`), and an invalid reply never ends an episode with its points
    /// kept: `end_episode` becomes `random` (a uniformly random legal action replaces it, and
    /// it counts in the invalid rate).
    pub fn eval_rollout_config(&self) -> RolloutConfig {
        let mut rollout = self.rollout_config();
        rollout.max_episode_steps = self.eval.max_episode_steps.unwrap_or(usize::MAX);
        if rollout.action.fallback == Fallback::EndEpisode {
            rollout.action.fallback = Fallback::Random;
        }
        rollout
    }

    /// The rollout settings of training: `action:` and `training.max_episode_steps`.
    pub fn rollout_config(&self) -> RolloutConfig {
        RolloutConfig { action: self.action.clone(), max_episode_steps: self.training.max_episode_steps }
    }

    /// The reward pipeline of `rewards:`.
    pub fn reward_pipeline(&self) -> Result<RewardPipeline> {
        self.rewards.pipeline()
    }

    /// Builds the environment from `env:` (and `eval.env`'s variant, when given) and checks what
    /// needs it: one agent per seat, and an action mode the environment supports (`constrained`
    /// and `choice` need a finite action set). The environment returned may have been reset;
    /// reset it before use. `origin` names the config file in errors.
    pub fn build_env(&self, origin: &Path, registry: &Registry) -> Result<Box<dyn Environment>> {
        let fail =
            |key: String, message: String| TroupeError::BadValue { origin: Some(origin.to_path_buf()), key, message };
        let env = registry.make_from_spec(&self.env.spec()).map_err(|err| match err {
            EnvError::BadParam { field, message, .. } => fail(format!("env.{field}"), message),
            EnvError::UnknownEnv { .. } => fail("env.name".into(), err.to_string()),
            other => fail("env".into(), other.to_string()),
        })?;
        if !self.eval.env.is_empty() {
            registry.make_from_spec(&self.eval_env_spec()).map_err(|err| match err {
                EnvError::BadParam { field, message, .. } => fail(format!("eval.env.{field}"), message),
                other => fail("eval.env".into(), other.to_string()),
            })?;
        }
        if env.num_seats() != self.agents.seats.len() {
            return Err(fail(
                "agents.seats".into(),
                format!(
                    "{:?} names {} seats but {} has {}",
                    self.agents.seats,
                    self.agents.seats.len(),
                    self.env.name,
                    env.num_seats()
                ),
            ));
        }
        let mut env = env;
        let needs_finite = self.action.mode.decider().needs_finite_actions();
        if needs_finite || self.training.format_warmup.steps > 0 {
            // The built environment is the probe (every caller resets it before use).
            let probe = &mut env;
            probe.reset(self.run.seed);
            if let Some(&seat) = probe.acting_seats().first() {
                if probe.legal_actions(seat).is_none() && !needs_finite {
                    return Err(fail(
                        "training.format_warmup.steps".into(),
                        format!("the format warm-up needs a finite set of legal actions, but {} takes open-ended text; set it to 0", self.env.name),
                    ));
                }
                if probe.legal_actions(seat).is_none() {
                    return Err(fail(
                        "action.mode".into(),
                        format!(
                            "`{}` needs a finite set of legal actions, but {} takes open-ended text; use `free`",
                            self.action.mode, self.env.name
                        ),
                    ));
                }
            }
        }
        Ok(env)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Preset;
    use crate::rl::credit::rewards::{RewardFunction, RewardProcessor, WeightedReward};

    fn parse(text: &str, overrides: &[&str]) -> Result<TrainConfig> {
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        TrainConfig::from_yaml_str(text, Path::new("configs/test.yaml"), &overrides, &Registry::with_builtins())
    }

    fn error(text: &str, overrides: &[&str]) -> String {
        parse(text, overrides).expect_err("this config must be refused").to_string()
    }

    #[test]
    fn empty_file_gives_the_documented_defaults() {
        let config = parse("", &[]).unwrap();
        assert_eq!(config, TrainConfig::default());
        assert_eq!(config.run.iterations, 30);
        assert_eq!(config.env.spec(), serde_json::json!({"name": "hanabi", "players": 2}));
        assert_eq!(config.agents.seats, vec![0, 1]);
        assert_eq!(config.action.mode, ActionMode::Free);
        assert_eq!(config.action.fallback, Fallback::Random);
        assert_eq!(config.training.optimizer.lr, 1.0e-4);
        assert_eq!(config.eval.seed, 1_000_000);
        assert_eq!(config.model.preset(), Ok(Preset::Tiny));
        assert_eq!(config.adapter_config(), AdapterConfig::default());
    }

    #[test]
    fn sections_override_defaults_field_by_field() {
        let config = parse(
            "training: {group_size: 8}\nenv: {name: bridge, rotate_boards: true}\nagents: {seats: [0, 1, 0, 1]}\n\
             action: {mode: choice}\neval: {baseline_seats: {1: rule}}\n",
            &[],
        )
        .unwrap();
        assert_eq!(config.training.group_size, 8);
        assert_eq!(config.training.groups_per_iteration, 2, "untouched fields keep their default");
        assert_eq!(config.env.spec(), serde_json::json!({"name": "bridge", "rotate_boards": true}));
        assert_eq!(config.eval.baseline_seats.get(&1).map(String::as_str), Some("rule"));
    }

    #[test]
    fn wrong_type_names_file_and_key() {
        assert_eq!(
            error("training:\n  group_size: four\n", &[]),
            "configs/test.yaml: training.group_size: invalid type: string \"four\", expected usize"
        );
        let err = error("agents: {seats: [0, x]}", &[]);
        assert!(err.starts_with("configs/test.yaml: agents.seats[1]: invalid type"), "{err}");
    }

    #[test]
    fn unknown_keys_are_refused_with_the_key() {
        let err = error("training: {group_sise: 4}", &[]);
        assert!(err.contains("training.group_sise") && err.contains("unknown field `group_sise`"), "{err}");
        let err = error("trainning: {group_size: 4}", &[]);
        assert!(err.contains("unknown field `trainning`"), "{err}");
        let err = error("action: {mode: freestyle}", &[]);
        assert!(err.contains("action.mode") && err.contains("unknown variant `freestyle`"), "{err}");
        assert!(err.contains("expected one of `free`, `constrained`, `choice`"), "{err}");
        let err = error("rewards: {processors: [{type: clamp, min: 0, max: 1, extra: 2}]}", &[]);
        assert!(err.contains("rewards.processors[0]") && err.contains("extra"), "{err}");
        let err = error("adapter: {target_modules: [q_proj, x_proj]}", &[]);
        assert!(err.contains("adapter.target_modules[1]") && err.contains("x_proj"), "{err}");
    }

    #[test]
    fn runtime_micro_batch_tokens_and_checkpointing_read_and_refuse_by_name() {
        let config = parse("runtime: {micro_batch_tokens: 2048, gradient_checkpointing: true}", &[]).unwrap();
        assert_eq!(config.runtime.micro_batch_tokens, Some(2048));
        assert!(config.runtime.gradient_checkpointing);
        let defaults = parse("", &[]).unwrap();
        assert_eq!((defaults.runtime.micro_batch_tokens, defaults.runtime.gradient_checkpointing), (None, false));
        let err = error("runtime: {micro_batch_tokens: 0}", &[]);
        assert!(err.starts_with("configs/test.yaml: runtime.micro_batch_tokens: must be at least 1"), "{err}");
        let err = error("runtime: {micro_batch_tokens: many}", &[]);
        assert!(err.contains("runtime.micro_batch_tokens") && err.contains("invalid type"), "{err}");
        let err = error("", &["runtime.micro_batch_tokens=99999999999"]);
        assert!(err.contains("runtime.micro_batch_tokens") && err.contains("too large"), "{err}");
        let err = error("runtime: {gradient_checkpointing: 3}", &[]);
        assert!(err.contains("runtime.gradient_checkpointing") && err.contains("invalid type"), "{err}");
    }

    #[test]
    fn runtime_attention_reads_refuses_by_name_and_reaches_the_model() {
        use crate::model::AttentionKernel;
        assert_eq!(parse("", &[]).unwrap().runtime.attention, AttentionKernel::Auto);
        assert_eq!(parse("runtime: {attention: flash}", &[]).unwrap().runtime.attention, AttentionKernel::Flash);
        let set = parse("runtime: {attention: flash}", &["runtime.attention=materialized"]).unwrap();
        assert_eq!(set.runtime.attention, AttentionKernel::Materialized);
        assert_eq!(
            error("runtime: {attention: fast}", &[]),
            "configs/test.yaml: runtime.attention: unknown variant `fast`, expected one of `auto`, `flash`, `materialized`"
        );
        let err = error("", &["runtime.attention=3"]);
        assert!(err.contains("runtime.attention: ") && !err.contains('\n'), "{err}");
        // The model a run loads takes the kernel (the CPU then runs its fused attention anyway).
        let config = parse("runtime: {attention: flash}", &[]).unwrap();
        let model = crate::rl::run::load_model(&config, &burn::tensor::Device::flex()).unwrap();
        assert_eq!(model.lm.attention_kernel(), AttentionKernel::Flash);
    }

    #[test]
    fn runtime_prompt_cache_reads_refuses_by_name_and_reaches_the_model() {
        use crate::model::PromptCache;
        assert_eq!(parse("", &[]).unwrap().runtime.prompt_cache, PromptCache::Auto);
        let set = parse("runtime: {prompt_cache: shared}", &["runtime.prompt_cache=copied"]).unwrap();
        assert_eq!(set.runtime.prompt_cache, PromptCache::Copied);
        assert_eq!(
            error("runtime: {prompt_cache: once}", &[]),
            "configs/test.yaml: runtime.prompt_cache: unknown variant `once`, expected one of `auto`, `shared`, `copied`"
        );
        let config = parse("runtime: {prompt_cache: shared}", &[]).unwrap();
        let model = crate::rl::run::load_model(&config, &burn::tensor::Device::flex()).unwrap();
        assert_eq!(model.lm.prompt_cache(), PromptCache::Shared);
        assert!(model.lm.shares_prompts(), "asked for, the CPU shares too");
    }

    #[test]
    fn runtime_kv_cache_reads_refuses_by_name_and_reaches_the_model() {
        use crate::model::KvCacheDtype;
        assert_eq!(parse("", &[]).unwrap().runtime.kv_cache, KvCacheDtype::Auto);
        let set = parse("runtime: {kv_cache: auto}", &["runtime.kv_cache=f32"]).unwrap();
        assert_eq!(set.runtime.kv_cache, KvCacheDtype::F32);
        assert_eq!(
            error("runtime: {kv_cache: bf8}", &[]),
            "configs/test.yaml: runtime.kv_cache: unknown variant `bf8`, expected `auto` or `f32`"
        );
        let config = parse("runtime: {kv_cache: f32}", &[]).unwrap();
        let model = crate::rl::run::load_model(&config, &burn::tensor::Device::flex()).unwrap();
        assert_eq!(model.lm.kv_cache(), KvCacheDtype::F32);
        assert_eq!(model.lm.cache_dtype(), None, "the CPU holds f32");
    }

    #[test]
    fn yaml_syntax_errors_name_the_file() {
        let err = error("training: {group_size: 4\n", &[]);
        assert!(err.starts_with("configs/test.yaml: ") && err.contains("line"), "{err}");
        let err = error("- a\n- b\n", &[]);
        assert!(err.contains("mapping of sections"), "{err}");
    }

    #[test]
    fn seats_naming_a_missing_agent_are_refused() {
        let err = error("agents: {num_agents: 2, seats: [0, 1, 2, 1]}", &[]);
        assert!(err.starts_with("configs/test.yaml: agents.seats[2]: agent 2 does not exist"), "{err}");
        let err = error("agents: {num_agents: 3, seats: [0, 1]}", &[]);
        assert!(err.contains("agents.num_agents") && err.contains("agent 2 plays no seat"), "{err}");
        assert!(error("agents: {seats: []}", &[]).contains("agents.seats"));
    }

    #[test]
    fn ranges_are_validated() {
        for (text, key) in [
            ("training: {group_size: 1}", "training.group_size"),
            ("training: {optimizer: {lr: 0}}", "training.optimizer.lr"),
            ("training: {lr: -1.0e-4}", "training.optimizer.lr"),
            ("training: {optimizer: {beta2: 1.0}}", "training.optimizer.beta2"),
            ("training: {gamma: 1.5}", "training.gamma"),
            ("training: {max_grad_norm: -1}", "training.max_grad_norm"),
            ("action: {top_p: 0}", "action.top_p"),
            ("action: {max_new_tokens: 0}", "action.max_new_tokens"),
            ("action: {temperature: -0.5}", "action.temperature"),
            ("adapter: {r: 0}", "adapter.r"),
            ("adapter: {lora_dropout: 1.0}", "adapter.lora_dropout"),
            ("run: {checkpoint_every: 0}", "run.checkpoint_every"),
            ("model: {preset: huge}", "model.preset"),
            ("model: {device: tpu}", "model.device"),
            ("env: {name: chess}", "env.name"),
            ("rewards: {functions: []}", "rewards.functions"),
            ("rewards: {processors: [{type: clamp, min: 1, max: 0}]}", "rewards.processors[0].max"),
            ("eval: {episodes: 0}", "eval.episodes"),
            ("eval: {baseline_seats: {5: rule}}", "eval.baseline_seats.5"),
            ("eval: {baseline_seats: {1: genius}}", "eval.baseline_seats.1"),
            ("training: {partners: [{1: rule}, {7: rule}]}", "training.partners[1].7"),
            ("training: {partners: [{1: genius}]}", "training.partners[0].1"),
            ("training: {partners: [{0: rule, 1: random}]}", "training.partners[0]"),
            ("training: {groups_per_iteration: 1, partners: [{1: rule}, {0: rule}]}", "training.partners"),
        ] {
            let err = error(text, &[]);
            assert!(err.starts_with(&format!("configs/test.yaml: {key}: ")), "{text}: {err}");
        }
        let err = error("env: {name: chess}", &[]);
        assert!(err.contains("hanabi"), "lists the registered environments: {err}");
        // A model path makes the preset irrelevant.
        assert!(parse("model: {path: /models/qwen3, preset: huge}", &[]).is_ok());
    }

    #[test]
    fn overrides_apply_before_parsing() {
        let config = parse(
            "training: {group_size: 4}\nagents: {num_agents: 2, seats: [0, 1]}\n",
            &[
                "training.group_size=6",
                "training.lr=3e-4",
                "run.out_dir=/tmp/run x",
                "env.name=bridge",
                "env.players=",
                "agents.seats=[0, 1, 0, 1]",
                "agents.seats[3]=0",
                "agents.seats.2=1",
                "eval.baseline_seats.1=rule",
                "model.path=/models/qwen3",
                "rewards.processors=[{type: scale, factor: 2}]",
                "rewards.processors[0].factor=3",
            ],
        )
        .unwrap();
        assert_eq!(config.training.group_size, 6);
        assert_eq!(config.training.optimizer.lr, 3e-4);
        assert_eq!(config.run.out_dir, PathBuf::from("/tmp/run x"));
        assert_eq!(config.agents.seats, vec![0, 1, 1, 0]);
        assert_eq!(config.eval.baseline_seats.get(&1).map(String::as_str), Some("rule"));
        assert_eq!(config.model.path, Some(PathBuf::from("/models/qwen3")));
        assert_eq!(config.rewards.processors, vec![RewardProcessor::Scale { factor: 3.0 }]);
        // `env.players=` set the parameter to null; env params are free-form.
        assert_eq!(config.env.params.get("players"), Some(&serde_json::Value::Null));
    }

    #[test]
    fn indexing_a_list_the_file_leaves_out_starts_from_the_default() {
        let config = parse("", &["agents.seats[1]=0", "agents.num_agents=1", "rewards.functions[0].weight=2"]).unwrap();
        assert_eq!(config.agents.seats, vec![0, 0]);
        assert_eq!(config.rewards.functions, vec![WeightedReward::builtin(RewardFunction::EnvReturn, 2.0)]);
    }

    #[test]
    fn bad_overrides_are_named() {
        let err = error("", &["training.lrr=0.1"]);
        assert!(err.starts_with("--set: training.lrr: unknown key") && err.contains("optimizer,"), "{err}");
        let err = error("", &["trainig.lr=0.1"]);
        assert!(err.contains("trainig.lr: unknown key (known sections: run, model"), "{err}");
        let err = error("", &["training.group_size=four"]);
        assert!(err.contains("training.group_size: invalid type: string \"four\""), "{err}");
        // `--set` and the key are each said once.
        assert_eq!(error("", &["training.lr"]), "--set: training.lr: not of the form key.path=value");
        assert_eq!(error("", &["training..lr=1"]), "--set: training..lr: malformed key");
        let err = error("", &["run="]);
        assert!(err.starts_with("--set: run: a section, not a value; set its keys (run.KEY=VALUE)"), "{err}");
        let err = error("", &["env.players=[2"]);
        assert!(err.starts_with("--set: env.players: the value is not YAML: "), "{err}");
        for err in [error("", &["run="]), error("", &["env.players=[2"]), error("", &["training.lr"])] {
            assert_eq!(err.matches("--set").count(), 1, "{err}");
        }
        let err = error("", &["agents.seats[5]=1"]);
        assert!(err.contains("agents.seats[5]: index 5 is out of range: agents.seats has 2 entries"), "{err}");
        let err = error("", &["model.path[0]=x"]);
        assert!(err.contains("model.path[0]: model.path is not a list"), "{err}");
        let err = error("", &["training.gamma.x=1"]);
        assert!(err.contains("training.gamma is a value, not a section"), "{err}");
        let err = error("agents: {seats: [0, 1]}", &["agents.seats[5]=1"]);
        assert!(err.contains("index 5 is out of range: agents.seats has 2 entries"), "{err}");
    }

    #[test]
    fn resolved_yaml_round_trips() {
        let config = parse(
            "env: {name: bridge, rotate_boards: true}\nagents: {seats: [0, 1, 0, 1]}\naction: {mode: choice}\n\
             rewards: {functions: [{name: score, weight: 0.5}, {name: invalid_actions}], processors: [{type: clamp, min: -1, max: 1}, {type: sigmoid}]}\n\
             eval: {baseline_seats: {1: random}}\n",
            &[],
        )
        .unwrap();
        let yaml = config.to_yaml().unwrap();
        let again = parse(&yaml, &[]).unwrap();
        assert_eq!(again, config, "{yaml}");
    }

    #[test]
    fn env_checks_need_the_built_env() {
        let registry = Registry::with_builtins();
        let origin = Path::new("configs/test.yaml");
        let config = parse("env: {name: bridge}", &[]).unwrap();
        let err = config.build_env(origin, &registry).err().expect("bridge has 4 seats").to_string();
        assert!(err.contains("agents.seats") && err.contains("bridge has 4"), "{err}");
        let config = parse("env: {name: hanabi, players: 9}", &[]).unwrap();
        let err = config.build_env(origin, &registry).err().expect("9 players is too many").to_string();
        assert!(err.starts_with("configs/test.yaml: env.players"), "{err}");
        let config = parse("env: {name: writing}\naction: {mode: choice}", &[]).unwrap();
        let err = config.build_env(origin, &registry).err().expect("writing has no finite actions").to_string();
        assert!(err.contains("action.mode"), "{err}");
        let config = parse("env: {name: writing}\naction: {mode: constrained}", &[]).unwrap();
        let err = config.build_env(origin, &registry).err().expect("writing has no finite actions").to_string();
        assert!(err.starts_with("configs/test.yaml: action.mode: `constrained` needs a finite set"), "{err}");
        for (env, seats) in [("hanabi", "[0, 1]"), ("bridge", "[0, 1, 0, 1]")] {
            let config =
                parse(&format!("env: {{name: {env}}}\nagents: {{seats: {seats}}}\naction: {{mode: constrained}}"), &[])
                    .unwrap();
            assert_eq!(config.action.mode, ActionMode::Constrained);
            assert_eq!(config.rollout_config().action.mode, ActionMode::Constrained);
            assert!(config.build_env(origin, &registry).is_ok(), "{env} has finite legal actions");
        }
        let config = parse("env: {name: hanabi, players: 3}\nagents: {seats: [0, 1, 0]}", &[]).unwrap();
        assert_eq!(config.build_env(origin, &registry).unwrap().num_seats(), 3);
    }

    #[test]
    fn sections_are_the_components_own_configs() {
        let config = parse(
            "run: {seed: 7}\nenv: {name: bridge}\nagents: {seats: [0, 1, 0, 1]}\n\
             action: {mode: choice, fallback: end_episode, temperature: 0.5, max_new_tokens: 5}\n\
             training: {group_size: 3, optimizer: {lr: 2.0e-4, weight_decay: 0.1}, warmup_iterations: 4, max_episode_steps: 9, kl: {coef: 0.5}}\n\
             runtime: {micro_batch_rows: 4}",
            &[],
        )
        .unwrap();
        assert_eq!(config.env.spec(), serde_json::json!({"name": "bridge"}));
        assert_eq!((config.training.group_size, config.training.groups_per_iteration, config.run.seed), (3, 2, 7));
        let adamw = &config.training.optimizer;
        assert_eq!(
            (adamw.lr, adamw.weight_decay, adamw.beta2),
            (2.0e-4, 0.1, 0.999),
            "unset keys keep AdamW's defaults"
        );
        assert_eq!(config.training.kl, crate::rl::objective::KlPenalty { coef: 0.5, ..Default::default() });
        let rollout = config.rollout_config();
        assert_eq!((rollout.action.mode, rollout.action.fallback), (ActionMode::Choice, Fallback::EndEpisode));
        assert_eq!((rollout.action.max_new_tokens, rollout.max_episode_steps), (5, 9));
        assert_eq!(rollout.action.sampling().temperature, 0.5);
        assert_eq!(
            config.eval_rollout_config().action.fallback,
            Fallback::Random,
            "evaluation never ends a game early"
        );
    }

    #[test]
    fn moved_keys_and_overrides_still_load() {
        let config = parse(
            "training: {lr: 2.0e-4, beta1: 0.8, kl_coef: 0.1, format_warmup_steps: 3}\n",
            &["training.weight_decay=0.05", "training.kl_estimator=k1"],
        )
        .unwrap();
        let t = &config.training;
        assert_eq!((t.optimizer.lr, t.optimizer.beta1, t.optimizer.weight_decay), (2.0e-4, 0.8, 0.05));
        assert_eq!((t.kl.coef, t.kl.estimator), (0.1, crate::rl::objective::KlEstimator::K1));
        assert_eq!(t.format_warmup.steps, 3);
    }

    #[test]
    fn saved_config_reloads_from_the_run_dir() {
        let dir = tempfile::tempdir().unwrap();
        let config =
            parse("training: {group_size: 3}\nenv: {name: hanabi, players: 3}\nagents: {seats: [0, 1, 0]}", &[])
                .unwrap();
        let path = config.save(&dir.path().join("run")).unwrap();
        assert_eq!(path, dir.path().join("run").join(CONFIG_FILE));
        assert_eq!(TrainConfig::from_run_dir(&dir.path().join("run"), &Registry::with_builtins()).unwrap(), config);
        let err = TrainConfig::from_run_dir(dir.path(), &Registry::with_builtins()).unwrap_err().to_string();
        assert!(err.contains("config.yaml"), "{err}");
    }

    /// Every file in `configs/` parses, validates and builds its environment.
    #[test]
    fn shipped_configs_load_and_build_their_envs() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let registry = Registry::with_builtins();
        let mut files: Vec<PathBuf> = std::fs::read_dir(root.join("configs"))
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "yaml" || ext == "yml"))
            .collect();
        files.sort();
        let names: Vec<String> = files.iter().map(|p| p.file_stem().unwrap().to_string_lossy().into_owned()).collect();
        for expected in ["bridge", "coding", "hanabi", "writing"] {
            assert!(names.iter().any(|n| n == expected), "configs/{expected}.yaml is missing: {names:?}");
        }
        for path in &files {
            let config =
                TrainConfig::from_yaml_file(path, &[], &Registry::with_builtins()).unwrap_or_else(|e| panic!("{e}"));
            let env = match config.build_env(path, &registry) {
                // An OpenSpiel config needs `pip install open_spiel`, which a bare machine lacks;
                // its loading is checked above, its process where OpenSpiel is installed.
                Err(e) if config.env.name == "external" && e.to_string().contains("OpenSpiel is not installed") => {
                    eprintln!("{}: not built, OpenSpiel is not installed", path.display());
                    continue;
                }
                built => built.unwrap_or_else(|e| panic!("{e}")),
            };
            assert_eq!(env.num_seats(), config.agents.seats.len(), "{}", path.display());
            if config.env.name != "external" {
                assert_eq!(env.name(), config.env.name);
            }
        }
    }
}
