//! Driving whole episodes with policies: one episode, a benchmark over many, and an interactive
//! game where a person plays one seat in the terminal. All of it works for any
//! [`Environment`], turn-based games and open-ended text tasks alike.

use std::io::{BufRead, Write};
use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::environment::{Action, Environment, EpisodeMetrics, SeatId};
use crate::error::EnvError;
use crate::policy::Policy;

/// Joint steps after which an episode is declared stuck (no shipped environment comes near).
pub const MAX_EPISODE_STEPS: usize = 100_000;

/// The outcome of one episode.
#[derive(Clone, Debug, Serialize)]
pub struct EpisodeSummary {
    /// The seed the episode was reset with.
    pub seed: u64,
    /// The `score` metric, or the mean return where the environment reports no score.
    pub score: f64,
    /// Joint steps taken.
    pub steps: usize,
    /// Each seat's return.
    pub returns: Vec<f64>,
    /// The environment's episode metrics.
    pub metrics: EpisodeMetrics,
}

/// The seed of a policy's randomness in the episode seeded `seed` (kept apart from the deal).
pub fn policy_seed(seed: u64) -> u64 {
    seed ^ 0x5DEE_CE66_D1CE_5EED
}

fn summary(env: &dyn Environment, seed: u64, steps: usize) -> EpisodeSummary {
    let returns = env.returns();
    let metrics = env.metrics();
    let mean_return = if returns.is_empty() { 0.0 } else { returns.iter().sum::<f64>() / returns.len() as f64 };
    let score = metrics.get("score").copied().unwrap_or(mean_return);
    EpisodeSummary { seed, score, steps, returns, metrics }
}

/// Plays one episode from `seed` with `policy` in every seat.
pub fn run_episode(env: &mut dyn Environment, policy: &mut dyn Policy, seed: u64) -> Result<EpisodeSummary, EnvError> {
    crate::batch::reset_one(env, seed)?;
    let mut rng = ChaCha8Rng::seed_from_u64(policy_seed(seed));
    let mut steps = 0;
    while !env.is_terminal() {
        if steps >= MAX_EPISODE_STEPS {
            return Err(EnvError::Policy {
                policy: policy.name().into(),
                env: env.name().into(),
                message: format!("episode with seed {seed} did not end within {MAX_EPISODE_STEPS} steps"),
            });
        }
        let seats = env.acting_seats();
        let actions = seats.iter().map(|&s| policy.act(&*env, s, &mut rng)).collect::<Result<Vec<_>, _>>()?;
        env.step(&actions).map_err(|error| EnvError::Action { env: env.name().into(), error })?;
        steps += 1;
    }
    Ok(summary(env, seed, steps))
}

/// What `troupe env bench` prints.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// The environment's name.
    pub env: String,
    /// The policy's name.
    pub policy: String,
    /// Episodes played (seeds `seed`, `seed + 1`, ...).
    pub episodes: usize,
    /// Mean of the episodes' scores.
    pub mean_score: f64,
    /// Population standard deviation of the scores.
    pub std_score: f64,
    /// Mean joint steps per episode.
    pub mean_length: f64,
    /// Joint steps per second of wall time (policy time included).
    pub steps_per_second: f64,
    /// Wall time in seconds.
    pub seconds: f64,
}

/// Plays `episodes` episodes with seeds `seed..seed + episodes` and summarises them.
pub fn bench(
    env: &mut dyn Environment,
    policy: &mut dyn Policy,
    episodes: usize,
    seed: u64,
) -> Result<BenchReport, EnvError> {
    let start = Instant::now();
    let mut scores = Vec::with_capacity(episodes);
    let mut steps = 0usize;
    for i in 0..episodes {
        let result = run_episode(env, policy, seed.wrapping_add(i as u64))?;
        scores.push(result.score);
        steps += result.steps;
    }
    let seconds = start.elapsed().as_secs_f64();
    let n = episodes.max(1) as f64;
    let mean = scores.iter().sum::<f64>() / n;
    let var = scores.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / n;
    Ok(BenchReport {
        env: env.name().to_string(),
        policy: policy.name().to_string(),
        episodes,
        mean_score: mean,
        std_score: var.sqrt(),
        mean_length: steps as f64 / n,
        steps_per_second: if seconds > 0.0 { steps as f64 / seconds } else { 0.0 },
        seconds,
    })
}

fn io_error(err: std::io::Error) -> EnvError {
    EnvError::Data { path: "<terminal>".to_string(), message: err.to_string() }
}

/// Reads one reply from `input`: a line for games with a finite action set; for open-ended text
/// tasks, lines up to one holding only `END` (or the end of input). `None` at end of input.
fn read_reply(input: &mut dyn BufRead, multiline: bool) -> Result<Option<String>, EnvError> {
    let mut reply = String::new();
    loop {
        let mut line = String::new();
        if input.read_line(&mut line).map_err(io_error)? == 0 {
            return Ok(if reply.is_empty() { None } else { Some(reply) });
        }
        if !multiline {
            return Ok(Some(line));
        }
        if line.trim() == "END" {
            return Ok(Some(reply));
        }
        reply.push_str(&line);
    }
}

/// A person plays `human` against `policy` in the other seats: the person sees exactly the text
/// an agent sees (instructions once, then the observation at each turn), types a reply, and an
/// unreadable or illegal reply is explained and asked again. Ends early (with the episode as
/// far as it got) when `input` runs out.
pub fn play_interactive(
    env: &mut dyn Environment,
    human: SeatId,
    policy: &mut dyn Policy,
    seed: u64,
    input: &mut dyn BufRead,
    output: &mut dyn Write,
) -> Result<EpisodeSummary, EnvError> {
    if human >= env.num_seats() {
        return Err(EnvError::BadParam {
            env: env.name().into(),
            field: "seat".into(),
            message: format!("{human} is not a seat of this environment (0 to {})", env.num_seats() - 1),
        });
    }
    crate::batch::reset_one(env, seed)?;
    let mut rng = ChaCha8Rng::seed_from_u64(policy_seed(seed));
    let mut steps = 0;
    writeln!(output, "{}\n", env.instructions(human)).map_err(io_error)?;
    'episode: while !env.is_terminal() {
        let seats = env.acting_seats();
        let mut actions: Vec<Action> = Vec::with_capacity(seats.len());
        for &seat in &seats {
            if seat != human {
                actions.push(policy.act(&*env, seat, &mut rng)?);
                continue;
            }
            let multiline = env.legal_actions(seat).is_none();
            loop {
                writeln!(output, "{}", env.observation(seat)).map_err(io_error)?;
                let hint = if multiline { "your reply, then a line END" } else { "your action" };
                write!(output, "[seat {seat}] {hint}> ").map_err(io_error)?;
                output.flush().map_err(io_error)?;
                let Some(reply) = read_reply(input, multiline)? else {
                    break 'episode;
                };
                match env.parse_action(seat, &reply) {
                    Ok(action) => {
                        actions.push(action);
                        break;
                    }
                    Err(err) => writeln!(output, "Not accepted: {err}\n").map_err(io_error)?,
                }
            }
        }
        env.step(&actions).map_err(|error| EnvError::Action { env: env.name().into(), error })?;
        steps += 1;
    }
    writeln!(output, "{}", env.observation(human)).map_err(io_error)?;
    let result = summary(&*env, seed, steps);
    writeln!(output, "Episode over: score {}, returns {:?}.", result.score, result.returns).map_err(io_error)?;
    Ok(result)
}
