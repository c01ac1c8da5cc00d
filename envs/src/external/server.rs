//! The server side of the external protocol for any registered environment: what
//! `troupe env serve NAME` runs, and what the protocol-equivalence tests compare against the
//! in-process environment.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};

use serde_json::{json, Map, Value};

use super::protocol::{WireAction, WireState, PROTOCOL_VERSION};
use crate::environment::Environment;
use crate::error::EnvError;
use crate::registry::Registry;

/// Serves environment `name` of `registry` over `input`/`output` until `input` ends. The
/// parameters of `init` are laid over `base_params` (a JSON object). A request that cannot be
/// served is answered with an `error`; only a failure to write ends the loop early.
pub fn serve(
    registry: &Registry,
    name: &str,
    base_params: &Value,
    input: impl BufRead,
    mut output: impl Write,
) -> Result<(), EnvError> {
    let mut server = Server { registry, name, params: base_params.clone(), episodes: BTreeMap::new() };
    for line in input.lines() {
        let line = line.map_err(|err| io_error(name, err))?;
        if line.trim().is_empty() {
            continue;
        }
        let answer = match serde_json::from_str::<Value>(&line) {
            Ok(Value::Object(request)) => {
                let id = request.get("id").cloned().unwrap_or(Value::Null);
                match server.handle(&request) {
                    Ok(result) => json!({"id": id, "result": result}),
                    Err(message) => json!({"id": id, "error": message}),
                }
            }
            _ => json!({"id": null, "error": "the request is not a JSON object"}),
        };
        writeln!(output, "{answer}").and_then(|()| output.flush()).map_err(|err| io_error(name, err))?;
    }
    Ok(())
}

fn io_error(name: &str, err: std::io::Error) -> EnvError {
    EnvError::External { command: format!("troupe env serve {name}"), message: err.to_string() }
}

/// The served environment's parameters and live episodes.
struct Server<'a> {
    registry: &'a Registry,
    name: &'a str,
    params: Value,
    episodes: BTreeMap<u64, Box<dyn Environment>>,
}

impl Server<'_> {
    fn handle(&mut self, request: &Map<String, Value>) -> Result<Value, String> {
        match request.get("method").and_then(Value::as_str) {
            Some("init") => self.init(request),
            Some("reset") => self.reset(request),
            Some("step") => self.step(request),
            Some("parse") => self.parse(request),
            Some("close") => {
                for episode in field(request, "episodes")?.as_array().into_iter().flatten() {
                    if let Some(episode) = episode.as_u64() {
                        self.episodes.remove(&episode);
                    }
                }
                Ok(json!({}))
            }
            Some(other) => Err(format!("unknown method {other:?}")),
            None => Err("the request has no `method`".to_string()),
        }
    }

    fn init(&mut self, request: &Map<String, Value>) -> Result<Value, String> {
        let protocol = request.get("protocol").and_then(Value::as_u64);
        if protocol != Some(u64::from(PROTOCOL_VERSION)) {
            return Err(format!("protocol {protocol:?} is not supported (this server speaks {PROTOCOL_VERSION})"));
        }
        let mut params = self.params.as_object().cloned().unwrap_or_default();
        if let Some(Value::Object(extra)) = request.get("params") {
            params.extend(extra.clone());
        }
        self.params = Value::Object(params);
        self.episodes.clear();
        let probe = self.registry.make(self.name, &self.params).map_err(|e| e.to_string())?;
        Ok(json!({"name": probe.name(), "num_seats": probe.num_seats()}))
    }

    fn reset(&mut self, request: &Map<String, Value>) -> Result<Value, String> {
        let mut states = Vec::new();
        for entry in list(request, "episodes")? {
            let episode = entry.get("episode").and_then(Value::as_u64).ok_or("an entry has no `episode`")?;
            let seed = entry.get("seed").and_then(Value::as_u64).ok_or("an entry has no `seed`")?;
            if !self.episodes.contains_key(&episode) {
                let env = self.registry.make(self.name, &self.params).map_err(|e| e.to_string())?;
                self.episodes.insert(episode, env);
            }
            let env = self.episodes.get_mut(&episode).ok_or("episode vanished")?;
            env.reset(seed);
            states.push(state_of(env.as_ref()));
        }
        Ok(json!({"states": states}))
    }

    fn step(&mut self, request: &Map<String, Value>) -> Result<Value, String> {
        let mut results = Vec::new();
        for entry in list(request, "episodes")? {
            let episode = entry.get("episode").and_then(Value::as_u64).ok_or("an entry has no `episode`")?;
            let actions: Vec<WireAction> = serde_json::from_value(entry.get("actions").cloned().unwrap_or(Value::Null))
                .map_err(|e| format!("episode {episode}: bad `actions`: {e}"))?;
            let env = self.episodes.get_mut(&episode).ok_or_else(|| format!("unknown episode {episode}"))?;
            let actions: Vec<_> = actions.into_iter().map(Into::into).collect();
            results.push(match env.step(&actions) {
                Ok(rewards) => json!({"rewards": rewards, "state": state_of(env.as_ref())}),
                Err(err) => json!({"error": err.to_string()}),
            });
        }
        Ok(json!({"results": results}))
    }

    fn parse(&mut self, request: &Map<String, Value>) -> Result<Value, String> {
        let mut results = Vec::new();
        for entry in list(request, "requests")? {
            let episode = entry.get("episode").and_then(Value::as_u64).ok_or("an entry has no `episode`")?;
            let seat = entry.get("seat").and_then(Value::as_u64).ok_or("an entry has no `seat`")? as usize;
            let text = entry.get("text").and_then(Value::as_str).ok_or("an entry has no `text`")?;
            let env = self.episodes.get(&episode).ok_or_else(|| format!("unknown episode {episode}"))?;
            results.push(match env.parse_action(seat, text) {
                Ok(action) => json!({"action": WireAction::from(&action)}),
                Err(err) => json!({"error": err.to_string()}),
            });
        }
        Ok(json!({"results": results}))
    }
}

fn field<'a>(request: &'a Map<String, Value>, name: &str) -> Result<&'a Value, String> {
    request.get(name).ok_or_else(|| format!("the request has no `{name}`"))
}

fn list<'a>(request: &'a Map<String, Value>, name: &str) -> Result<&'a Vec<Value>, String> {
    field(request, name)?.as_array().ok_or_else(|| format!("`{name}` is not a list"))
}

/// Everything the protocol's State holds, read from an environment.
pub(crate) fn state_of(env: &dyn Environment) -> WireState {
    let seats = 0..env.num_seats();
    WireState {
        acting_seats: if env.is_terminal() { Vec::new() } else { env.acting_seats() },
        terminal: env.is_terminal(),
        instructions: seats.clone().map(|s| env.instructions(s)).collect(),
        observations: seats.clone().map(|s| env.observation(s)).collect(),
        legal_actions: seats.map(|s| env.legal_actions(s)).collect(),
        returns: env.returns(),
        metrics: env.metrics(),
    }
}
