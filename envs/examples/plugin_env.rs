//! A third-party environment plugged into troupe the way any crate outside the workspace would
//! do it: implement [`Environment`], register a constructor with typed parameters, and build it
//! from a config-style spec. The game: two seats each pick a number; they score 1 together when
//! the numbers sum to the target.
//!
//! `cargo run -p troupe-envs --example plugin_env`

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;
use serde_json::{json, Value};
use troupe_envs::policy::RandomPolicy;
use troupe_envs::runner::bench;
use troupe_envs::{
    parse_params, Action, ActionError, EnvError, Environment, EpisodeMetrics, LegalAction, Registry, SeatId,
};

/// The plug-in's typed parameters (`env: {name: sum_game, max: 5}`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct SumParams {
    /// Each seat picks a number in 0..=max.
    max: u32,
}

impl Default for SumParams {
    fn default() -> Self {
        Self { max: 3 }
    }
}

/// A simultaneous two-seat game: both act at once, one joint reward.
struct SumGame {
    max: u32,
    target: u32,
    done: bool,
    returns: Vec<f64>,
}

impl Environment for SumGame {
    fn name(&self) -> &str {
        "sum_game"
    }
    fn num_seats(&self) -> usize {
        2
    }
    fn reset(&mut self, seed: u64) {
        self.target = ChaCha8Rng::seed_from_u64(seed).random_range(0..=2 * self.max);
        self.done = false;
        self.returns = vec![0.0; 2];
    }
    fn acting_seats(&self) -> Vec<SeatId> {
        if self.done {
            vec![]
        } else {
            vec![0, 1]
        }
    }
    fn instructions(&self, _seat: SeatId) -> String {
        format!("Pick a number from 0 to {}; you and your partner score if they sum to the target.", self.max)
    }
    fn observation(&self, seat: SeatId) -> String {
        format!("You are seat {seat}. The target is {}.", self.target)
    }
    fn legal_actions(&self, _seat: SeatId) -> Option<Vec<LegalAction>> {
        Some((0..=self.max).map(|n| LegalAction { id: n, text: n.to_string() }).collect())
    }
    fn parse_action(&self, _seat: SeatId, text: &str) -> Result<Action, ActionError> {
        let answer = troupe_envs::text::answer_span(text);
        let number = answer.split(|c: char| !c.is_ascii_digit()).rev().find_map(|t| t.parse::<u32>().ok());
        match number {
            Some(n) if n <= self.max => Ok(Action::Id(n)),
            Some(n) => Err(ActionError::Illegal {
                action: n.to_string(),
                reason: format!("numbers run from 0 to {}", self.max),
            }),
            None => Err(ActionError::Unparseable { text: text.to_string(), reason: "expected a number".into() }),
        }
    }
    fn step(&mut self, actions: &[Action]) -> Result<Vec<f64>, ActionError> {
        if self.done {
            return Err(ActionError::EpisodeOver);
        }
        let [Action::Id(a), Action::Id(b)] = actions else {
            return Err(ActionError::WrongActionCount { expected: 2, got: actions.len() });
        };
        let reward = if a + b == self.target { 1.0 } else { 0.0 };
        self.done = true;
        self.returns = vec![reward; 2];
        Ok(self.returns.clone())
    }
    fn is_terminal(&self) -> bool {
        self.done
    }
    fn returns(&self) -> Vec<f64> {
        self.returns.clone()
    }
    fn metrics(&self) -> EpisodeMetrics {
        EpisodeMetrics::from([("score".to_string(), self.returns[0])])
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// What a plug-in crate exports: one function that registers its environments.
fn register(registry: &mut Registry) {
    registry.register("sum_game", "two seats pick numbers that must sum to a target", |params: &Value| {
        let p: SumParams = parse_params("sum_game", params)?;
        let mut env = SumGame { max: p.max, target: 0, done: false, returns: vec![0.0; 2] };
        env.reset(0);
        Ok(Box::new(env) as Box<dyn Environment>)
    });
}

fn main() -> Result<(), EnvError> {
    let mut registry = Registry::with_builtins();
    register(&mut registry);
    for (name, description) in registry.list() {
        println!("{name:10} {description}");
    }
    let mut env = registry.make_from_spec(&json!({"name": "sum_game", "max": 4}))?;
    env.reset(1);
    println!("{}", env.observation(0));
    println!("parsed: {:?}", env.parse_action(0, "I pick <answer>2</answer>"));
    let report = bench(env.as_mut(), &mut RandomPolicy, 1000, 0)?;
    println!(
        "random policy: {}",
        serde_json::to_string(&report).map_err(|e| EnvError::Data { path: "-".into(), message: e.to_string() })?
    );
    // The built-in baseline policies work on plug-ins; the Hanabi rule player says it cannot.
    let mut rule = registry.make_policy("rule")?;
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    println!("rule policy: {}", rule.act(env.as_ref(), 0, &mut rng).err().map(|e| e.to_string()).unwrap_or_default());
    let err = registry.make_from_spec(&json!({"name": "sum_game", "maximum": 4})).err().expect("unknown field");
    println!("a bad parameter: {err}");
    Ok(())
}
