//! An example troupe plug-in crate: a cooperative signalling game and a baseline policy that
//! plays it perfectly, registered beside troupe's own, with every `troupe` command (train,
//! resume, eval, plot, env list/play/bench/record/replay/serve) from a three-line `main`.
//!
//! ```sh
//! cargo run -p troupe-plugin-example -- env bench signal --episodes 100 --policy oracle
//! cargo run -p troupe-plugin-example --release -- train --config plugin-example/configs/signal.yaml
//! ```
//!
//! The game: seat 0 sees a secret colour and sends one of as many signals; seat 1 sees only the
//! signal and guesses the colour; both score 1 when the guess is right. The crate also registers
//! a reward function, `brevity`. Random play scores
//! 1 / colours; a team that agrees on a code scores 1.

use std::process::ExitCode;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;
use troupe::troupe_envs::policy::Policy;
use troupe::troupe_envs::{
    parse_params, Action, ActionError, EnvError, Environment, EpisodeMetrics, LegalAction, Registry, SeatId,
};

/// The colours, in signal order.
const COLOURS: [&str; 5] = ["red", "green", "blue", "white", "yellow"];

/// `env: {name: signal, colours: 3}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct SignalParams {
    /// How many colours (and signals) there are, 2 to 5.
    colours: usize,
}

impl Default for SignalParams {
    fn default() -> Self {
        Self { colours: 3 }
    }
}

/// The signalling game's state.
struct SignalGame {
    colours: usize,
    secret: usize,
    signal: Option<usize>,
    guess: Option<usize>,
}

impl SignalGame {
    fn from_params(params: &serde_json::Value) -> Result<Self, EnvError> {
        let p: SignalParams = parse_params("signal", params)?;
        if !(2..=COLOURS.len()).contains(&p.colours) {
            return Err(EnvError::BadParam {
                env: "signal".into(),
                field: "colours".into(),
                message: format!("{} is not between 2 and {}", p.colours, COLOURS.len()),
            });
        }
        Ok(Self { colours: p.colours, secret: 0, signal: None, guess: None })
    }

    fn score(&self) -> f64 {
        f64::from(u8::from(self.guess == Some(self.secret)))
    }
}

impl Environment for SignalGame {
    fn name(&self) -> &str {
        "signal"
    }

    fn num_seats(&self) -> usize {
        2
    }

    fn reset(&mut self, seed: u64) {
        self.secret = ChaCha8Rng::seed_from_u64(seed).random_range(0..self.colours);
        self.signal = None;
        self.guess = None;
    }

    fn acting_seats(&self) -> Vec<SeatId> {
        match (self.signal, self.guess) {
            (None, _) => vec![0],
            (Some(_), None) => vec![1],
            _ => vec![],
        }
    }

    fn instructions(&self, _seat: SeatId) -> String {
        "Seat 0 sees a secret colour and sends a signal; seat 1 sees the signal and guesses the colour.".to_string()
    }

    fn observation(&self, seat: SeatId) -> String {
        match (seat, self.signal) {
            (0, _) => format!("secret {}", COLOURS[self.secret]),
            (_, Some(signal)) => format!("signal {}", signal + 1),
            (_, None) => "wait".to_string(),
        }
    }

    fn legal_actions(&self, seat: SeatId) -> Option<Vec<LegalAction>> {
        let ids = 0..self.colours as u32;
        Some(match seat {
            _ if !self.acting_seats().contains(&seat) => Vec::new(),
            0 => ids.map(|id| LegalAction { id, text: format!("signal {}", id + 1) }).collect(),
            _ => ids.map(|id| LegalAction { id, text: format!("guess {}", COLOURS[id as usize]) }).collect(),
        })
    }

    fn parse_action(&self, seat: SeatId, text: &str) -> Result<Action, ActionError> {
        let wanted = text.trim().to_ascii_lowercase();
        self.legal_actions(seat)
            .unwrap_or_default()
            .into_iter()
            .find(|a| a.text == wanted)
            .map(|a| Action::Id(a.id))
            .ok_or_else(|| ActionError::Unparseable {
                text: text.to_string(),
                reason: "expected one of the legal actions".into(),
            })
    }

    fn step(&mut self, actions: &[Action]) -> Result<Vec<f64>, ActionError> {
        let seat = *self.acting_seats().first().ok_or(ActionError::EpisodeOver)?;
        let [Action::Id(id)] = actions else {
            return Err(ActionError::WrongActionCount { expected: 1, got: actions.len() });
        };
        let id = *id as usize;
        if id >= self.colours {
            return Err(ActionError::Illegal {
                action: id.to_string(),
                reason: format!("there are {} choices", self.colours),
            });
        }
        if seat == 0 {
            self.signal = Some(id);
            Ok(vec![0.0, 0.0])
        } else {
            self.guess = Some(id);
            Ok(vec![self.score(); 2])
        }
    }

    fn is_terminal(&self) -> bool {
        self.guess.is_some()
    }

    fn returns(&self) -> Vec<f64> {
        vec![self.score(); 2]
    }

    fn metrics(&self) -> EpisodeMetrics {
        EpisodeMetrics::from([("score".to_string(), self.score())])
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A baseline that plays the signalling game perfectly: signal i for colour i, guess colour i
/// for signal i.
struct OraclePolicy;

impl Policy for OraclePolicy {
    fn name(&self) -> &str {
        "oracle"
    }

    fn act(&mut self, env: &dyn Environment, seat: SeatId, _rng: &mut ChaCha8Rng) -> Result<Action, EnvError> {
        let game = env.as_any().downcast_ref::<SignalGame>().ok_or_else(|| EnvError::Policy {
            policy: "oracle".into(),
            env: env.name().into(),
            message: "the oracle plays the signal game only".into(),
        })?;
        let id = if seat == 0 { game.secret } else { game.signal.unwrap_or(0) };
        Ok(Action::Id(id as u32))
    }
}

/// What this plug-in adds to a registry.
fn register(registry: &mut Registry) {
    registry.register(
        "signal",
        "a cooperative signalling game: seat 0 signals a secret colour, seat 1 guesses it",
        |params| Ok(Box::new(SignalGame::from_params(params)?)),
    );
    registry.register_policy("oracle", "plays the signal game perfectly (signal i means colour i)", || {
        Box::new(OraclePolicy)
    });
    // A reward function configs can list beside the built-in ones:
    // `rewards: {functions: [{name: env_return}, {name: brevity, weight: 0.1}]}`.
    registry.register_reward("brevity", "minus the characters of the seat's replies, in hundreds", |input| {
        -(input.completions.iter().map(|c| c.chars().count()).sum::<usize>() as f64) / 100.0
    });
}

fn main() -> ExitCode {
    let mut registry = Registry::with_builtins();
    register(&mut registry);
    troupe::cli::main_with(registry)
}
