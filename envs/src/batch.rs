//! Resetting and stepping many episodes at once, as rollouts do: episodes of an external
//! environment that share a process go in one exchange; every other environment is driven one
//! episode at a time through the [`Environment`] trait.

use std::collections::BTreeMap;

use crate::environment::{Action, ActionError, Environment};
use crate::error::EnvError;
use crate::external::{process_key, reset_external, step_external, ExternalEnv};

/// Resets `envs[i]` with `seeds[i]`. Fails when an environment cannot start an episode (an
/// external process that crashed or broke the protocol), naming it.
pub fn reset_all(envs: &mut [Box<dyn Environment>], seeds: &[u64]) -> Result<(), EnvError> {
    let mut groups: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, (env, &seed)) in envs.iter_mut().zip(seeds).enumerate() {
        match process_key(env.as_ref()) {
            Some(key) => groups.entry(key).or_default().push(i),
            None => env.reset(seed),
        }
    }
    for indices in groups.values() {
        let batch: Vec<(&ExternalEnv, u64)> = indices.iter().map(|&i| (external(envs[i].as_ref()), seeds[i])).collect();
        reset_external(&batch)?;
    }
    Ok(())
}

/// Resets one environment, failing as [`reset_all`] does.
pub fn reset_one(env: &mut dyn Environment, seed: u64) -> Result<(), EnvError> {
    env.reset(seed);
    match env.as_any().downcast_ref::<ExternalEnv>().and_then(ExternalEnv::failure) {
        Some(failure) => Err(EnvError::External { command: external(env).command().to_string(), message: failure }),
        None => Ok(()),
    }
}

/// Applies joint actions: `steps[k] = (i, actions)` steps `envs[i]` (each index at most once).
/// Returns one result per entry of `steps`, in order, as [`Environment::step`] would.
pub fn step_all(
    envs: &mut [Box<dyn Environment>],
    steps: &[(usize, Vec<Action>)],
) -> Vec<Result<Vec<f64>, ActionError>> {
    let mut results: Vec<Option<Result<Vec<f64>, ActionError>>> = vec![None; steps.len()];
    let mut groups: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (k, (i, actions)) in steps.iter().enumerate() {
        match process_key(envs[*i].as_ref()) {
            Some(key) => groups.entry(key).or_default().push(k),
            None => results[k] = Some(envs[*i].step(actions)),
        }
    }
    for entries in groups.values() {
        let batch: Vec<(&ExternalEnv, &[Action])> =
            entries.iter().map(|&k| (external(envs[steps[k].0].as_ref()), steps[k].1.as_slice())).collect();
        for (&k, result) in entries.iter().zip(step_external(&batch)) {
            results[k] = Some(result);
        }
    }
    results.into_iter().map(|r| r.unwrap_or(Err(ActionError::EpisodeOver))).collect()
}

fn external(env: &dyn Environment) -> &ExternalEnv {
    env.as_any().downcast_ref::<ExternalEnv>().expect("grouped by process_key, so external")
}
