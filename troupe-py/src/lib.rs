//! `troupe._engine`: the Rust engine as a Python extension module. It is deliberately thin: a
//! training run ([`Run`]), a rollout worker ([`RolloutWorker`]) and two model helpers. The
//! Python package `troupe` (python/troupe/) builds the user-facing API (`MAGRPOTrainer`,
//! `troupe.ray`) on it.
//!
//! Data crosses the boundary as JSON text (configs as YAML): plans, episodes, metrics and
//! evaluation summaries. Python reward functions and environment objects come in as callables
//! that the engine calls back with the GIL taken again; every engine computation runs with the
//! GIL released, so other Python threads (a Ray actor's, a notebook's) keep running.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::Device;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use serde_json::{json, Value};
use troupe::rl::config::{RewardsConfig, TrainConfig};
use troupe::rl::eval::{play_held_out, MeanStderr};
use troupe::rl::rollout::EpisodeRecord;
use troupe::rl::run::{fresh_adapters, load_model, PendingIteration, TrainingRun};
use troupe::rl::trainer::{MagrpoTrainer, RolloutPlan};
use troupe::troupe_envs::external::transport::{InProcess, Transport};
use troupe::troupe_envs::external::{register_in_process, TransportFactory};
use troupe::troupe_envs::Registry;

/// A Python exception carrying an engine error's message.
fn engine_error(err: impl std::fmt::Display) -> PyErr {
    PyRuntimeError::new_err(err.to_string())
}

/// A Python exception's type and message, for an engine error that names its source.
fn python_message(py: Python<'_>, err: PyErr) -> String {
    let name = err.get_type(py).name().map(|n| n.to_string()).unwrap_or_else(|_| "Exception".into());
    format!("{name}: {}", err.value(py))
}

/// Moves a value that is not `Send` into code run with the GIL released. Sound here because
/// the value is only touched by the thread that released the GIL, which waits for the closure.
struct Detached<T>(T);

impl<T> Detached<T> {
    /// The value (a method, so a closure captures the whole `Detached`, not its field).
    fn into_inner(self) -> T {
        self.0
    }
}

// SAFETY: `Detached` only carries a borrow into `Python::detach`, which runs the closure on the
// calling thread and returns before the borrow ends; nothing is sent to another thread.
unsafe impl<T> Send for Detached<T> {}

/// Runs `f` with the GIL released.
fn without_gil<T, R: Send>(py: Python<'_>, value: T, f: impl FnOnce(T) -> R + Send) -> R {
    let value = Detached(value);
    py.detach(move || f(value.into_inner()))
}

/// A registry with the built-in environments plus the Python reward functions and environment
/// factories given as `(name, callable)` pairs.
///
/// A reward callable takes the iteration's episodes as JSON text (a list of
/// [`troupe::troupe_envs::RewardItem`]) and returns one list of floats per episode (one value, or
/// one per seat). An environment factory takes no argument and returns an object with a
/// `call(request_line: str) -> str` method answering the external protocol (the Python package
/// wraps a `troupe.Environment` in the same server `python/troupe_env.py` runs).
fn registry_with(rewards: Vec<(String, Py<PyAny>)>, envs: Vec<(String, Py<PyAny>)>) -> Registry {
    let mut registry = Registry::with_builtins();
    for (name, function) in rewards {
        registry.register_batch_reward(&name, "a Python reward function", move |items| {
            let text = serde_json::to_string(items).map_err(|e| e.to_string())?;
            Python::attach(|py| {
                function
                    .call1(py, (text,))
                    .and_then(|answer| answer.extract::<Vec<Vec<f64>>>(py))
                    .map_err(|err| python_message(py, err))
            })
        });
    }
    for (name, factory) in envs {
        let factory = Arc::new(factory);
        let connect: TransportFactory = Arc::new(move || {
            let server = Python::attach(|py| factory.call0(py).map_err(|err| python_message(py, err)))?;
            let handler = move |line: &str| {
                Python::attach(|py| {
                    server
                        .call_method1(py, "call", (line,))
                        .and_then(|answer| answer.extract::<String>(py))
                        .map_err(|err| python_message(py, err))
                })
            };
            Ok(Box::new(InProcess::new(Box::new(handler))) as Box<dyn Transport>)
        });
        register_in_process(&mut registry, &name, "a Python environment object", connect);
    }
    registry
}

/// The config in `yaml` (`origin` names it in errors), checked against `registry`.
fn parse_config(yaml: &str, origin: &str, registry: &Registry) -> PyResult<TrainConfig> {
    TrainConfig::from_yaml_str(yaml, Path::new(origin), &[], registry).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// The device a config names.
fn config_device(config: &TrainConfig) -> PyResult<Device> {
    troupe::device::parse_device(&config.model.device).map_err(engine_error)
}

/// Episodes as JSON bytes (what crosses process boundaries).
fn episodes_to_bytes(episodes: &[EpisodeRecord]) -> PyResult<Vec<u8>> {
    serde_json::to_vec(episodes).map_err(engine_error)
}

/// Parses a [`RolloutPlan`] from JSON.
fn parse_plan(text: &str) -> PyResult<RolloutPlan> {
    serde_json::from_str(text).map_err(|e| PyValueError::new_err(format!("not a rollout plan: {e}")))
}

/// Plays episodes `start..end` of `plan` on `trainer`, as JSON bytes.
fn play_range(py: Python<'_>, trainer: &MagrpoTrainer, plan: &str, start: usize, end: usize) -> PyResult<Py<PyBytes>> {
    let plan = parse_plan(plan)?;
    let bytes = without_gil(py, trainer, |t| t.play(&plan, start..end).map_err(|e| e.to_string()))
        .map_err(engine_error)
        .and_then(|episodes| episodes_to_bytes(&episodes))?;
    Ok(PyBytes::new(py, &bytes).unbind())
}

/// A training run (a run directory, its trainer, its metrics), driven from Python.
#[pyclass(unsendable, module = "troupe._engine")]
struct Run {
    // Boxed: the engine's types may need more alignment than Python's allocator gives the
    // object that holds them.
    run: Box<TrainingRun>,
    pending: Option<Box<PendingIteration>>,
}

#[pymethods]
impl Run {
    /// Starts a run from `config_yaml` (or resumes the one in `resume_dir`, with `--set`-style
    /// `overrides` such as `run.iterations=40`), with Python reward
    /// functions and environment factories registered under their names.
    #[new]
    #[pyo3(signature = (config_yaml, origin, rewards, envs, resume_dir=None, overrides=Vec::new()))]
    fn new(
        py: Python<'_>,
        config_yaml: &str,
        origin: &str,
        rewards: Vec<(String, Py<PyAny>)>,
        envs: Vec<(String, Py<PyAny>)>,
        resume_dir: Option<PathBuf>,
        overrides: Vec<String>,
    ) -> PyResult<Self> {
        let registry = registry_with(rewards, envs);
        let run = match resume_dir {
            Some(dir) => {
                let device = troupe::device::default_device().map_err(engine_error)?;
                without_gil(py, (registry, device), |(registry, device)| {
                    TrainingRun::resume(&dir, &overrides, registry, &device).map_err(|e| e.to_string())
                })
            }
            None => {
                let config = parse_config(config_yaml, origin, &registry)?;
                let device = config_device(&config)?;
                without_gil(py, (config, registry, device), |(config, registry, device)| {
                    TrainingRun::start(config, Path::new(origin), registry, &device).map_err(|e| e.to_string())
                })
            }
        }
        .map_err(engine_error)?;
        Ok(Self { run: Box::new(run), pending: None })
    }

    /// Iterations done.
    fn iteration(&self) -> u64 {
        self.run.iteration()
    }

    /// Whether every configured iteration is done.
    fn finished(&self) -> bool {
        self.run.finished()
    }

    /// The run directory.
    fn run_dir(&self) -> PathBuf {
        self.run.run_dir.clone()
    }

    /// The resolved config, as YAML (what `config.yaml` holds).
    fn config_yaml(&self) -> PyResult<String> {
        self.run.config.to_yaml().map_err(engine_error)
    }

    /// One whole iteration (rollouts here); returns its metrics line as JSON.
    fn run_iteration(&mut self, py: Python<'_>) -> PyResult<String> {
        let metrics = without_gil(py, &mut *self.run, |run| run.run_iteration().map_err(|e| e.to_string()))
            .map_err(engine_error)?;
        serde_json::to_string(&metrics).map_err(engine_error)
    }

    /// Begins an iteration whose rollouts are played elsewhere: the format warm-up at
    /// iteration 0, then the plan (JSON). Ship the adapters as they are after this call.
    fn begin_iteration(&mut self, py: Python<'_>) -> PyResult<String> {
        if self.pending.is_some() {
            return Err(PyValueError::new_err("an iteration is already begun; finish it first"));
        }
        let pending = without_gil(py, &mut *self.run, |run| run.begin_iteration().map_err(|e| e.to_string()))
            .map_err(engine_error)?;
        let plan = serde_json::to_string(&pending.plan).map_err(engine_error)?;
        self.pending = Some(Box::new(pending));
        Ok(plan)
    }

    /// Plays episodes `start..end` of `plan` (JSON) with this run's adapters: episodes as JSON
    /// bytes.
    fn play(&self, py: Python<'_>, plan: &str, start: usize, end: usize) -> PyResult<Py<PyBytes>> {
        play_range(py, &self.run.trainer, plan, start, end)
    }

    /// Finishes the begun iteration with its episodes: `parts` are JSON byte strings from
    /// `play`, in plan order, together covering the plan. Returns the metrics line as JSON.
    fn finish_iteration(&mut self, py: Python<'_>, parts: Vec<Vec<u8>>, rollout_seconds: f64) -> PyResult<String> {
        let pending = self.pending.take().ok_or_else(|| PyValueError::new_err("no iteration is begun"))?;
        let mut episodes: Vec<EpisodeRecord> = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            let mut some: Vec<EpisodeRecord> = serde_json::from_slice(part)
                .map_err(|e| PyValueError::new_err(format!("part {i} does not hold episodes: {e}")))?;
            episodes.append(&mut some);
        }
        let metrics = without_gil(py, (&mut *self.run, pending), |(run, pending)| {
            run.finish_iteration(*pending, episodes, rollout_seconds).map_err(|e| e.to_string())
        })
        .map_err(engine_error)?;
        serde_json::to_string(&metrics).map_err(engine_error)
    }

    /// Plays `episodes` held-out episodes (`eval.env` over the config's env, seeds `eval.seed`
    /// on, every seat its agent) and scores them with the run's reward pipeline. Returns JSON:
    /// per agent the reward's mean and standard error, the `score` metric's, and the first
    /// episodes' replies.
    #[pyo3(signature = (episodes=None))]
    fn evaluate(&self, py: Python<'_>, episodes: Option<usize>) -> PyResult<String> {
        let summary = without_gil(py, &*self.run, |run| evaluate_rewards(run, episodes).map_err(|e| e.to_string()))
            .map_err(engine_error)?;
        Ok(summary.to_string())
    }

    /// Saves every agent's adapter in PEFT's layout under `dir` (`dir/agent_0/...`).
    fn save_adapters(&self, py: Python<'_>, dir: PathBuf) -> PyResult<()> {
        without_gil(py, &*self.run, |run| run.trainer.manager.save_adapters(&dir).map_err(|e| e.to_string()))
            .map_err(engine_error)
    }

    /// Writes a checkpoint now; returns its directory.
    fn checkpoint(&mut self, py: Python<'_>) -> PyResult<PathBuf> {
        without_gil(py, &mut *self.run, |run| run.checkpoint().map_err(|e| e.to_string())).map_err(engine_error)
    }

    /// Writes the run's base model as a Hugging Face directory under `out` (the built-in preset
    /// with its seed; refused for a model loaded from a path, which is on disk already), for
    /// tools that load models from disk (transformers + PEFT).
    fn write_base_model(&self, py: Python<'_>, out: PathBuf) -> PyResult<()> {
        let model = &self.run.config.model;
        if let Some(path) = &model.path {
            return Err(PyValueError::new_err(format!("the base model is on disk already: {}", path.display())));
        }
        let preset = model.preset().map_err(PyValueError::new_err)?;
        let seed = model.seed;
        without_gil(py, (), |()| {
            troupe::model::builtin::write_model_dir(&out, preset, seed, troupe::model::safetensors_io::StoredFloat::F32)
                .map_err(|e| e.to_string())
        })
        .map_err(engine_error)
    }

    /// The token ids of `text` and, for each token after the first, its log-probability under
    /// the base with agent `agent`'s adapter (`None`: the base alone).
    #[pyo3(signature = (text, agent=None))]
    fn logprobs(&self, py: Python<'_>, text: &str, agent: Option<usize>) -> PyResult<(Vec<u32>, Vec<f32>)> {
        without_gil(py, &*self.run, |run| {
            let t = &run.trainer;
            let ids = t.model.tokenizer.encode(text).map_err(|e| e.to_string())?;
            let (delta, _) = t.manager.mixed(&[agent], false).map_err(|e| e.to_string())?;
            let rows = troupe::generate::score_rows(
                &t.model.lm,
                std::slice::from_ref(&ids),
                Some(&delta as &dyn troupe::model::ProjectionDelta),
            )
            .map_err(|e| e.to_string())?;
            Ok((ids, rows.into_iter().next().unwrap_or_default()))
        })
        .map_err(|e: String| engine_error(e))
    }
}

/// The body of [`Run::evaluate`].
fn evaluate_rewards(run: &TrainingRun, episodes: Option<usize>) -> troupe::Result<Value> {
    let config = &run.config;
    let t = &run.trainer;
    let count = episodes.unwrap_or(config.eval.episodes).max(1);
    // Every seat is its agent's, whatever `eval.baseline_seats` says.
    let records = play_held_out(&t.model, &t.manager, config, count, t.registry(), &mut Default::default())?;
    let scored = t.credit().score_episodes(&t.model.tokenizer, &records, &[])?;
    let rewards = scored.rewards;
    let mut per_agent = serde_json::Map::new();
    for agent in t.manager.agent_ids() {
        let values: Vec<f64> = rewards
            .iter()
            .map(|per_seat| {
                per_seat
                    .iter()
                    .enumerate()
                    .filter(|(seat, _)| config.agents.seats.get(*seat) == Some(&agent))
                    .map(|(_, r)| r)
                    .sum()
            })
            .collect();
        let m = MeanStderr::of(&values);
        per_agent.insert(agent.to_string(), json!({"mean": m.mean, "stderr": m.stderr}));
    }
    let scores: Vec<f64> = records.iter().map(|e| e.metrics.get("score").copied().unwrap_or(0.0)).collect();
    let score = MeanStderr::of(&scores);
    let mut functions = serde_json::Map::new();
    for (label, values) in scored.functions {
        let m = MeanStderr::of(&values);
        functions.insert(label, json!({"mean": m.mean, "stderr": m.stderr}));
    }
    let decode = |ids: &[u32]| t.model.tokenizer.decode(ids, true);
    let mut samples = Vec::new();
    for record in records.iter().take(3) {
        let replies =
            record.turns.iter().map(|turn| decode(&turn.completion_ids)).collect::<troupe::Result<Vec<_>>>()?;
        samples.push(json!({"seed": record.seed, "replies": replies}));
    }
    Ok(json!({
        "episodes": count,
        "first_seed": config.eval.seed,
        "reward": per_agent,
        "rewards": functions,
        "score": {"mean": score.mean, "stderr": score.stderr},
        "samples": samples,
    }))
}

/// A rollout worker: the frozen base once, the agents' adapters as the learner last sent them,
/// playing ranges of a learner's plans. It computes no reward (the learner does).
#[pyclass(unsendable, module = "troupe._engine")]
struct RolloutWorker {
    // Boxed for alignment, as `Run`.
    trainer: Box<MagrpoTrainer>,
}

#[pymethods]
impl RolloutWorker {
    /// A worker for the run `config_yaml` describes, with the Python environment factories it
    /// needs registered under their names.
    #[new]
    fn new(py: Python<'_>, config_yaml: &str, origin: &str, envs: Vec<(String, Py<PyAny>)>) -> PyResult<Self> {
        // Reward functions are the learner's: the worker's registry needs none of them, so a
        // config naming Python rewards is read against a registry that knows their names.
        let registry = registry_with(Vec::new(), envs);
        let mut check = registry.clone();
        for name in reward_names(config_yaml) {
            check.register_batch_reward(&name, "checked by the learner", |_| {
                Err("a rollout worker computes no reward".into())
            });
        }
        let config = parse_config(config_yaml, origin, &check)?;
        let device = config_device(&config)?;
        let trainer = without_gil(py, (config, registry, device), |(config, registry, device)| {
            let model = load_model(&config, &device).map_err(|e| e.to_string())?;
            let manager = fresh_adapters(&config, &model).map_err(|e| e.to_string())?;
            // A rollout worker computes no reward: the learner does.
            let config = TrainConfig { rewards: RewardsConfig::default(), ..config };
            MagrpoTrainer::new(model, manager, registry, &config).map_err(|e| e.to_string())
        })
        .map_err(engine_error)?;
        Ok(Self { trainer: Box::new(trainer) })
    }

    /// Replaces the agents' adapters with those saved under `dir` (PEFT layout, as
    /// `Run.save_adapters` writes them).
    fn load_adapters(&mut self, py: Python<'_>, dir: PathBuf) -> PyResult<()> {
        without_gil(py, &mut *self.trainer, |t| t.manager.load_adapters(&dir).map_err(|e| e.to_string()))
            .map_err(engine_error)
    }

    /// Plays episodes `start..end` of `plan` (JSON): episodes as JSON bytes.
    fn play(&self, py: Python<'_>, plan: &str, start: usize, end: usize) -> PyResult<Py<PyBytes>> {
        play_range(py, &self.trainer, plan, start, end)
    }
}

/// The names listed under `rewards.functions` in a YAML config (empty when there are none).
fn reward_names(config_yaml: &str) -> Vec<String> {
    let value: serde_yaml::Value = serde_yaml::from_str(config_yaml).unwrap_or(serde_yaml::Value::Null);
    value["rewards"]["functions"]
        .as_sequence()
        .map(|list| list.iter().filter_map(|f| f["name"].as_str().map(str::to_string)).collect())
        .unwrap_or_default()
}

/// A metrics line (JSON, as [`Run::run_iteration`] returns it) under TRL's GRPO metric names,
/// as `run.report_to: [tensorboard]` logs it: `(name, value)` pairs for a tracker such as W&B.
#[pyfunction]
fn trl_scalars(metrics_json: &str) -> PyResult<Vec<(String, f64)>> {
    let metrics: troupe::rl::IterationMetrics =
        serde_json::from_str(metrics_json).map_err(|e| PyValueError::new_err(format!("metrics line: {e}")))?;
    Ok(troupe::rl::run::tracking::trl_scalars(&metrics))
}

/// The extension module.
#[pymodule]
fn _engine(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Run>()?;
    m.add_class::<RolloutWorker>()?;
    m.add_function(wrap_pyfunction!(trl_scalars, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
