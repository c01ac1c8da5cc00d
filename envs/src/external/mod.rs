//! Environments written in any language: troupe starts a process from the config
//! (`env: {name: external, command: [python3, my_env.py], params: {...}}`) and talks to it in
//! JSON lines over its stdin and stdout. The protocol is specified in envs/README.md
//! ("Environments in any language"); [`serve`] is its server side for any [`Environment`],
//! and `python/troupe_env.py` is the same for Python.
//!
//! One process serves every episode built from the same parameters (the registry keeps it for
//! as long as the registry lives); [`crate::batch`] resets and steps many of its episodes in one
//! exchange. Every answer is checked: a process that crashes, hangs past `timeout_s`, prints
//! something that is not the protocol, or hands back an action that is not legal fails with an
//! error naming its command and the offending message, and is killed.

pub mod process;
pub mod protocol;
mod server;
pub mod transport;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::environment::{Action, ActionError, Environment, EpisodeMetrics, LegalAction, SeatId};
use crate::error::EnvError;
use crate::registry::{parse_params, Registry};
use process::{CallError, Process};
use protocol::{
    empty_state, WireAction, WireHello, WireParseResult, WireResults, WireState, WireStates, WireStepResult,
    PROTOCOL_VERSION,
};
pub use server::serve;
use transport::Transport;

/// The parameters of `env: {name: external, ...}`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExternalParams {
    /// The process's argv, run from troupe's working directory.
    pub command: Vec<String>,
    /// Handed to the process as is in `init` (`{}` when absent).
    #[serde(default)]
    pub params: Value,
    /// The longest wait for one answer, in seconds.
    #[serde(default = "default_timeout_s")]
    pub timeout_s: f64,
    /// The longest answer line read from the process, in bytes (a longer one stops the run).
    #[serde(default = "default_max_line_bytes")]
    pub max_line_bytes: usize,
}

fn default_max_line_bytes() -> usize {
    process::DEFAULT_MAX_LINE_BYTES
}

/// Most seats an environment may declare in `init` (every state carries one entry per seat).
pub const MAX_SEATS: usize = 4096;

fn default_timeout_s() -> f64 {
    30.0
}

impl ExternalParams {
    /// Reads and checks the parameters: a non-empty command, a positive finite time limit.
    pub fn from_params(params: &Value) -> Result<Self, EnvError> {
        let parsed: Self = parse_params("external", params)?;
        let bad = |field: &str, message: &str| EnvError::BadParam {
            env: "external".to_string(),
            field: field.to_string(),
            message: message.to_string(),
        };
        if parsed.command.is_empty() || parsed.command[0].is_empty() {
            return Err(bad("command", "must name a program, e.g. [python3, my_env.py]"));
        }
        if !(parsed.timeout_s.is_finite() && parsed.timeout_s > 0.0) {
            return Err(bad("timeout_s", &format!("{} is not a positive number of seconds", parsed.timeout_s)));
        }
        if parsed.max_line_bytes == 0 {
            return Err(bad("max_line_bytes", "must be at least 1"));
        }
        if !(parsed.params.is_null() || parsed.params.is_object()) {
            return Err(bad("params", "must be a mapping"));
        }
        Ok(parsed)
    }

    /// The command line as one string, for messages.
    pub fn command_line(&self) -> String {
        self.command.join(" ")
    }
}

/// Registers `external` into `registry`. Environments built from equal parameters share one
/// process, started on first use and killed when the registry (and every environment built
/// from it) is dropped; a process that failed is replaced by a fresh one on the next build.
pub fn register(registry: &mut Registry) {
    let processes: Arc<Mutex<BTreeMap<String, Arc<Backend>>>> = Arc::default();
    registry.register(
        "external",
        "An environment in another process, any language: JSON lines over stdin/stdout (envs/README.md)",
        move |params| {
            let parsed = ExternalParams::from_params(params)?;
            let key = params.to_string();
            let mut processes = processes.lock().unwrap_or_else(|e| e.into_inner());
            let backend = match processes.get(&key) {
                Some(backend) if !backend.is_broken() => Arc::clone(backend),
                _ => {
                    let backend = Arc::new(Backend::start(&parsed)?);
                    processes.insert(key, Arc::clone(&backend));
                    backend
                }
            };
            Ok(Box::new(ExternalEnv::new(backend)))
        },
    );
}

/// Makes a fresh in-process protocol server (see [`register_in_process`]).
pub type TransportFactory = Arc<dyn Fn() -> Result<Box<dyn Transport>, String> + Send + Sync>;

/// Registers environment `name` served in this process by a protocol server that `connect`
/// makes (one per distinct set of parameters, kept for the registry's life, as `external`
/// keeps its processes): the Python package registers a Python environment object this way,
/// with every check `external` makes. The config's parameters (`env: {name: NAME, ...}` less
/// `name`) are sent in `init`.
pub fn register_in_process(registry: &mut Registry, name: &str, description: &str, connect: TransportFactory) {
    let servers: Arc<Mutex<BTreeMap<String, Arc<Backend>>>> = Arc::default();
    let label = name.to_string();
    registry.register(name, description, move |params| {
        let key = params.to_string();
        let mut servers = servers.lock().unwrap_or_else(|e| e.into_inner());
        let backend = match servers.get(&key) {
            Some(backend) if !backend.is_broken() => Arc::clone(backend),
            _ => {
                let transport = connect().map_err(|message| EnvError::External { command: label.clone(), message })?;
                let backend = Arc::new(Backend::connect(label.clone(), transport, params)?);
                servers.insert(key, Arc::clone(&backend));
                backend
            }
        };
        Ok(Box::new(ExternalEnv::new(backend)))
    });
}

/// One episode's answer to `step`: its rewards and new state, or why the step was refused.
type StepOutcome = Result<(Vec<f64>, WireState), String>;

/// One server (a process, or one in this process) and what it said about itself.
pub(crate) struct Backend {
    command: String,
    name: String,
    num_seats: usize,
    process: Mutex<Box<dyn Transport>>,
    next_episode: AtomicU64,
    /// Episodes dropped since the last exchange: sent as one `close` before the next request.
    closed: Mutex<Vec<u64>>,
    /// The metric keys of the first state the process sent, which every later state must
    /// repeat (envs/README.md: "keep the same keys in every episode").
    metric_keys: Mutex<Option<Vec<String>>>,
}

impl Backend {
    /// Starts the process and exchanges `init`.
    fn start(params: &ExternalParams) -> Result<Self, EnvError> {
        let command = params.command_line();
        let timeout = Duration::from_secs_f64(params.timeout_s);
        let process = Process::start_with_line_limit(&params.command, timeout, params.max_line_bytes)
            .map_err(|message| EnvError::External { command: command.clone(), message })?;
        Self::connect(command, Box::new(process), &params.params)
    }

    /// Exchanges `init` (with `init_params`) over `process`; `command` names the server in
    /// errors.
    fn connect(command: String, mut process: Box<dyn Transport>, init_params: &Value) -> Result<Self, EnvError> {
        let fail = |message: String| EnvError::External { command: command.clone(), message };
        let init_params = if init_params.is_null() { json!({}) } else { init_params.clone() };
        let mut fields = Map::new();
        fields.insert("protocol".to_string(), json!(PROTOCOL_VERSION));
        fields.insert("params".to_string(), init_params);
        let result = process.call("init", fields).map_err(|err| fail(call_message("init", err)))?;
        let hello: WireHello = serde_json::from_value(result.clone())
            .map_err(|err| fail(format!("answered `init` with {result}: {err}")))?;
        if hello.num_seats == 0 || hello.num_seats > MAX_SEATS {
            return Err(fail(format!("answered `init` with num_seats {} (1 to {MAX_SEATS})", hello.num_seats)));
        }
        Ok(Self {
            command,
            name: hello.name,
            num_seats: hello.num_seats,
            process: Mutex::new(process),
            next_episode: AtomicU64::new(0),
            closed: Mutex::new(Vec::new()),
            metric_keys: Mutex::new(None),
        })
    }

    fn is_broken(&self) -> bool {
        self.process.lock().map_or(true, |p| p.is_broken())
    }

    fn error(&self, message: String) -> EnvError {
        EnvError::External { command: self.command.clone(), message }
    }

    /// One exchange, after telling the process which episodes troupe dropped.
    fn call(&self, method: &str, fields: Map<String, Value>) -> Result<Value, EnvError> {
        let mut process = self.process.lock().unwrap_or_else(|e| e.into_inner());
        let closed = std::mem::take(&mut *self.closed.lock().unwrap_or_else(|e| e.into_inner()));
        if !closed.is_empty() {
            let mut close = Map::new();
            close.insert("episodes".to_string(), json!(closed));
            process.call("close", close).map_err(|err| self.error(call_message("close", err)))?;
        }
        process.call(method, fields).map_err(|err| self.error(call_message(method, err)))
    }

    /// Breaks the process over an answer that does not hold up, returning the error.
    fn protocol_error(&self, method: &str, message: String) -> EnvError {
        let mut process = self.process.lock().unwrap_or_else(|e| e.into_inner());
        match process.break_with(format!("answered `{method}` wrongly: {message}")) {
            CallError::Broken(message) | CallError::Refused(message) => self.error(message),
        }
    }

    /// Checks a state the process sent (`place` names its episode in the error): its shape
    /// ([`WireState::check`]) and its metric keys, which must be those of the first state.
    fn check_state(&self, method: &str, state: &WireState, place: &str) -> Result<(), EnvError> {
        state.check(self.num_seats).map_err(|m| self.protocol_error(method, format!("{place}: {m}")))?;
        let keys: Vec<&String> = state.metrics.keys().collect();
        let mut first = self.metric_keys.lock().unwrap_or_else(|e| e.into_inner());
        match first.as_ref() {
            None => *first = Some(keys.into_iter().cloned().collect()),
            Some(expected) if keys.iter().copied().eq(expected.iter()) => {}
            Some(expected) => {
                let message = format!(
                    "{place}: `metrics` has the keys {keys:?}, but the first state had {expected:?} \
                     (keep the same metric keys in every state)"
                );
                drop(first);
                return Err(self.protocol_error(method, message));
            }
        }
        Ok(())
    }

    /// Resets `(episode, seed)` pairs in one exchange; one checked state per pair.
    fn reset(&self, entries: &[(u64, u64)]) -> Result<Vec<WireState>, EnvError> {
        let episodes: Vec<Value> =
            entries.iter().map(|&(episode, seed)| json!({"episode": episode, "seed": seed})).collect();
        let mut fields = Map::new();
        fields.insert("episodes".to_string(), Value::Array(episodes));
        let result = self.call("reset", fields)?;
        let states: WireStates =
            serde_json::from_value(result).map_err(|err| self.protocol_error("reset", err.to_string()))?;
        if states.states.len() != entries.len() {
            let message = format!("{} states for {} episodes", states.states.len(), entries.len());
            return Err(self.protocol_error("reset", message));
        }
        for (state, &(episode, seed)) in states.states.iter().zip(entries) {
            self.check_state("reset", state, &format!("episode {episode} (seed {seed})"))?;
        }
        Ok(states.states)
    }

    /// Steps `(episode, actions)` pairs in one exchange. Per entry: the rewards and the checked
    /// new state, or the process's reason for refusing the step.
    fn step(&self, entries: &[(u64, &[Action])]) -> Result<Vec<StepOutcome>, EnvError> {
        let episodes: Vec<Value> = entries
            .iter()
            .map(|(episode, actions)| {
                let actions: Vec<WireAction> = actions.iter().map(WireAction::from).collect();
                json!({"episode": episode, "actions": actions})
            })
            .collect();
        let mut fields = Map::new();
        fields.insert("episodes".to_string(), Value::Array(episodes));
        let result = self.call("step", fields)?;
        let results: WireResults<WireStepResult> =
            serde_json::from_value(result).map_err(|err| self.protocol_error("step", err.to_string()))?;
        if results.results.len() != entries.len() {
            let message = format!("{} results for {} episodes", results.results.len(), entries.len());
            return Err(self.protocol_error("step", message));
        }
        let mut out = Vec::with_capacity(entries.len());
        for (result, (episode, _)) in results.results.into_iter().zip(entries) {
            match result {
                WireStepResult::Refused { error } => out.push(Err(error)),
                WireStepResult::Stepped { rewards, state } => {
                    if rewards.len() != self.num_seats || rewards.iter().any(|r| !r.is_finite()) {
                        let message = format!("episode {episode}: rewards {rewards:?} for {} seats", self.num_seats);
                        return Err(self.protocol_error("step", message));
                    }
                    self.check_state("step", &state, &format!("episode {episode}"))?;
                    out.push(Ok((rewards, state)));
                }
            }
        }
        Ok(out)
    }

    /// Asks the process to read `text` as an action of `seat` in `episode`.
    fn parse(&self, episode: u64, seat: SeatId, text: &str) -> Result<Result<Action, String>, EnvError> {
        let mut fields = Map::new();
        fields.insert("requests".to_string(), json!([{"episode": episode, "seat": seat, "text": text}]));
        let result = self.call("parse", fields)?;
        let results: WireResults<WireParseResult> =
            serde_json::from_value(result).map_err(|err| self.protocol_error("parse", err.to_string()))?;
        match results.results.into_iter().next() {
            Some(WireParseResult::Parsed { action }) => Ok(Ok(action.into())),
            Some(WireParseResult::Refused { error }) => Ok(Err(error)),
            None => Err(self.protocol_error("parse", "no result for the request".to_string())),
        }
    }
}

/// The message of a failed call.
fn call_message(method: &str, err: CallError) -> String {
    match err {
        CallError::Refused(message) => format!("refused `{method}`: {message}"),
        CallError::Broken(message) => message,
    }
}

/// One episode of an external environment: a handle on the shared process and the latest state
/// it sent (every query between steps is answered from it, with no exchange).
pub struct ExternalEnv {
    backend: Arc<Backend>,
    episode: u64,
    view: RefCell<View>,
}

/// The latest state, or why there is none.
struct View {
    state: WireState,
    /// What went wrong with the process (without the "external environment COMMAND:" that
    /// [`EnvError::External`] puts before it).
    failure: Option<String>,
}

impl ExternalEnv {
    fn new(backend: Arc<Backend>) -> Self {
        let episode = backend.next_episode.fetch_add(1, Ordering::Relaxed);
        let view = View { state: empty_state(backend.num_seats), failure: None };
        Self { backend, episode, view: RefCell::new(view) }
    }

    /// The process's command line.
    pub fn command(&self) -> &str {
        &self.backend.command
    }

    /// Why the environment cannot go on (the process failed), if it cannot: the message of
    /// the [`EnvError::External`] that names the command.
    pub fn failure(&self) -> Option<String> {
        self.view.borrow().failure.clone()
    }

    /// The failure as the error an action gets, naming the command once.
    fn failed_action(&self, failure: String) -> ActionError {
        ActionError::Failed(self.backend.error(failure).to_string())
    }

    fn fail(&self, err: &EnvError) {
        let mut view = self.view.borrow_mut();
        view.failure = Some(match err {
            EnvError::External { message, .. } => message.clone(),
            other => other.to_string(),
        });
        view.state = empty_state(self.backend.num_seats);
    }

    /// Checks a joint action locally (count, acting seats' legal ids) before it is sent.
    fn check_actions(&self, actions: &[Action]) -> Result<(), ActionError> {
        let view = self.view.borrow();
        if let Some(failure) = &view.failure {
            return Err(self.failed_action(failure.clone()));
        }
        if view.state.terminal {
            return Err(ActionError::EpisodeOver);
        }
        let acting = &view.state.acting_seats;
        if actions.len() != acting.len() {
            return Err(ActionError::WrongActionCount { expected: acting.len(), got: actions.len() });
        }
        for (&seat, action) in acting.iter().zip(actions) {
            if let (Action::Id(id), Some(legal)) = (action, &view.state.legal_actions[seat]) {
                if !legal.iter().any(|a| a.id == *id) {
                    return Err(ActionError::Illegal {
                        action: format!("{action}"),
                        reason: format!("not a legal action of seat {seat}"),
                    });
                }
            }
        }
        Ok(())
    }

    /// The joint action as the plug-in author reads it: each action by its listed text
    /// (`"play card 1" (action 3)`), or as it was given when the state lists no text for it.
    fn describe(&self, actions: &[Action]) -> String {
        let view = self.view.borrow();
        actions
            .iter()
            .enumerate()
            .map(|(i, action)| {
                let seat = view.state.acting_seats.get(i).copied();
                let listed = match (action, seat.and_then(|s| view.state.legal_actions.get(s))) {
                    (Action::Id(id), Some(Some(legal))) => legal.iter().find(|a| a.id == *id),
                    _ => None,
                };
                match listed {
                    Some(legal) => format!("{:?} ({action})", legal.text),
                    None => action.to_string(),
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl Drop for ExternalEnv {
    fn drop(&mut self) {
        self.backend.closed.lock().unwrap_or_else(|e| e.into_inner()).push(self.episode);
    }
}

impl Environment for ExternalEnv {
    fn name(&self) -> &str {
        &self.backend.name
    }

    fn num_seats(&self) -> usize {
        self.backend.num_seats
    }

    fn reset(&mut self, seed: u64) {
        // A failure is kept in the view (see `failure`), as the trait's reset cannot return it.
        let _ = reset_external(&[(&*self, seed)]);
    }

    fn acting_seats(&self) -> Vec<SeatId> {
        self.view.borrow().state.acting_seats.clone()
    }

    fn instructions(&self, seat: SeatId) -> String {
        self.view.borrow().state.instructions.get(seat).cloned().unwrap_or_default()
    }

    fn observation(&self, seat: SeatId) -> String {
        self.view.borrow().state.observations.get(seat).cloned().unwrap_or_default()
    }

    fn legal_actions(&self, seat: SeatId) -> Option<Vec<LegalAction>> {
        self.view.borrow().state.legal_actions.get(seat).cloned().unwrap_or(Some(Vec::new()))
    }

    fn parse_action(&self, seat: SeatId, text: &str) -> Result<Action, ActionError> {
        if let Some(failure) = self.failure() {
            return Err(self.failed_action(failure));
        }
        match self.backend.parse(self.episode, seat, text) {
            Ok(Ok(action)) => {
                let unlisted = match (&action, self.legal_actions(seat)) {
                    (Action::Id(id), Some(legal)) => (!legal.iter().any(|a| a.id == *id)).then_some(*id),
                    _ => None,
                };
                if let Some(id) = unlisted {
                    let err = self.backend.protocol_error(
                        "parse",
                        format!("{text:?} read as action {id}, which is not a legal action of seat {seat}"),
                    );
                    self.fail(&err);
                    return Err(ActionError::Failed(err.to_string()));
                }
                Ok(action)
            }
            Ok(Err(reason)) => Err(ActionError::Unparseable { text: text.to_string(), reason }),
            Err(err) => {
                self.fail(&err);
                Err(ActionError::Failed(err.to_string()))
            }
        }
    }

    fn step(&mut self, actions: &[Action]) -> Result<Vec<f64>, ActionError> {
        let mut results = step_external(&[(&*self, actions)]);
        results.remove(0)
    }

    fn is_terminal(&self) -> bool {
        let view = self.view.borrow();
        view.state.terminal || view.failure.is_some()
    }

    fn returns(&self) -> Vec<f64> {
        self.view.borrow().state.returns.clone()
    }

    fn metrics(&self) -> EpisodeMetrics {
        self.view.borrow().state.metrics.clone()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Resets external episodes that share one process in one exchange.
pub(crate) fn reset_external(envs: &[(&ExternalEnv, u64)]) -> Result<(), EnvError> {
    let Some((first, _)) = envs.first() else { return Ok(()) };
    let entries: Vec<(u64, u64)> = envs.iter().map(|(env, seed)| (env.episode, *seed)).collect();
    match first.backend.reset(&entries) {
        Ok(states) => {
            for ((env, _), state) in envs.iter().zip(states) {
                let mut view = env.view.borrow_mut();
                view.state = state;
                view.failure = None;
            }
            Ok(())
        }
        Err(err) => {
            for (env, _) in envs {
                env.fail(&err);
            }
            Err(err)
        }
    }
}

/// Steps external episodes that share one process in one exchange; one result per entry.
pub(crate) fn step_external(envs: &[(&ExternalEnv, &[Action])]) -> Vec<Result<Vec<f64>, ActionError>> {
    let mut results: Vec<Option<Result<Vec<f64>, ActionError>>> =
        envs.iter().map(|(env, actions)| env.check_actions(actions).err().map(Err)).collect();
    let sent: Vec<usize> = (0..envs.len()).filter(|&i| results[i].is_none()).collect();
    if let Some(&first) = sent.first() {
        let entries: Vec<(u64, &[Action])> = sent.iter().map(|&i| (envs[i].0.episode, envs[i].1)).collect();
        match envs[first].0.backend.step(&entries) {
            Ok(outcomes) => {
                for (&i, outcome) in sent.iter().zip(outcomes) {
                    let (env, actions) = &envs[i];
                    results[i] = Some(match outcome {
                        Ok((rewards, state)) => {
                            env.view.borrow_mut().state = state;
                            Ok(rewards)
                        }
                        Err(reason) => Err(ActionError::Illegal { action: env.describe(actions), reason }),
                    });
                }
            }
            Err(err) => {
                for &i in &sent {
                    envs[i].0.fail(&err);
                    results[i] = Some(Err(ActionError::Failed(err.to_string())));
                }
            }
        }
    }
    results.into_iter().map(|r| r.unwrap_or(Err(ActionError::EpisodeOver))).collect()
}

/// The identity of the process behind `env`, when it is external (episodes with the same key
/// can be batched together).
pub(crate) fn process_key(env: &dyn Environment) -> Option<usize> {
    env.as_any().downcast_ref::<ExternalEnv>().map(|e| Arc::as_ptr(&e.backend) as usize)
}
