//! `troupe env ...`: list, play, bench, record, replay and serve environments. The logic lives in
//! `troupe_envs` (runner, policy, records); this file only reads arguments and prints.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Subcommand;
use serde_json::{Map, Value};
use troupe_envs::{records, runner, Registry};

/// `troupe env` subcommands.
#[derive(Debug, Subcommand)]
pub enum EnvCommand {
    /// List the registered environments, baseline policies and reward functions.
    List,
    /// Serve an environment over the external protocol on stdin/stdout (envs/README.md): what an
    /// `env: {name: external, command: [troupe, env, serve, NAME]}` config runs.
    Serve {
        /// Environment name (`troupe env list`).
        name: String,
        /// Environment parameter, KEY=VALUE with a YAML/JSON scalar value (repeatable); `init`'s
        /// parameters are laid over these.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
    },
    /// Play one seat yourself in the terminal against baseline policies, seeing exactly the text
    /// the agents see.
    Play {
        /// Environment name (`troupe env list`).
        name: String,
        /// Episode seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// The seat you play.
        #[arg(long, default_value_t = 0)]
        seat: usize,
        /// Policy of the other seats (`random`, `rule`); default `rule` for Hanabi, else `random`.
        #[arg(long)]
        policy: Option<String>,
        /// Environment parameter, KEY=VALUE with a YAML/JSON scalar value (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
    },
    /// Play episodes with a baseline policy in every seat and print JSON statistics.
    Bench {
        /// Environment name.
        name: String,
        /// Number of episodes (seeds SEED, SEED+1, ...).
        #[arg(long)]
        episodes: usize,
        /// First episode seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Policy in every seat: `random`, `rule` (Hanabi) or `canonical` (coding: the
        /// reference solutions, so every episode runs the sandbox). Default: `canonical` for
        /// coding, `random` otherwise.
        #[arg(long)]
        policy: Option<String>,
        /// Environment parameter, KEY=VALUE with a YAML/JSON scalar value (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
    },
    /// Play games with a policy and write them as JSONL game records.
    Record {
        /// Game name (`hanabi` or `bridge`).
        name: String,
        /// Number of games.
        #[arg(long)]
        episodes: usize,
        /// First game seed.
        #[arg(long)]
        seed: u64,
        /// Policy in every seat: `random` or `rule` (Hanabi).
        #[arg(long)]
        policy: String,
        /// Environment parameter, KEY=VALUE with a YAML/JSON scalar value (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Output JSONL file (written atomically; an existing file is refused unless `--force`).
        #[arg(long)]
        out: PathBuf,
        /// Replace an existing `--out` file.
        #[arg(long)]
        force: bool,
    },
    /// Replay JSONL game records, checking every legal list, counter and final score; prints
    /// `N passed, M failed` and exits non-zero on any mismatch.
    Replay {
        /// Record files.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
}

/// Turns `--set KEY=VALUE` arguments into an environment parameter object; values are read as
/// YAML (so `3`, `true`, `small`, `"0"` and `[1, 2]` mean what a config file would mean).
pub fn parse_sets(sets: &[String]) -> anyhow::Result<Value> {
    let mut params = Map::new();
    for set in sets {
        let (key, raw) = set.split_once('=').with_context(|| format!("--set {set:?}: expected KEY=VALUE"))?;
        let key = key.trim();
        if key.is_empty() {
            bail!("--set {set:?}: the key is empty");
        }
        let yaml: serde_yaml::Value =
            serde_yaml::from_str(raw).with_context(|| format!("--set {key}: cannot read {raw:?} as a YAML value"))?;
        if let Some((_, value)) = crate::rl::config::file::non_finite_number(&yaml) {
            bail!("--set {key}: {value} is not a finite number");
        }
        let value = serde_json::to_value(yaml).with_context(|| format!("--set {key}: {raw:?} has no JSON form"))?;
        params.insert(key.to_string(), value);
    }
    Ok(Value::Object(params))
}

/// Runs one `troupe env` subcommand with the environments and policies of `registry`.
pub fn run(command: EnvCommand, registry: &Registry) -> anyhow::Result<()> {
    match command {
        EnvCommand::List => {
            for (name, description) in registry.list() {
                super::output::emit(format_args!("{name}\t{description}"))?;
            }
            for (name, description) in registry.policies() {
                super::output::emit(format_args!("policy {name}\t{description}"))?;
            }
            for (name, description) in registry.rewards() {
                super::output::emit(format_args!("reward {name}\t{description}"))?;
            }
            Ok(())
        }
        EnvCommand::Serve { name, set } => {
            let params = parse_sets(&set)?;
            registry.make(&name, &params)?;
            let stdin = std::io::stdin();
            troupe_envs::external::serve(registry, &name, &params, stdin.lock(), std::io::stdout().lock())?;
            Ok(())
        }
        EnvCommand::Play { name, seed, seat, policy, set } => {
            let mut env = registry.make(&name, &parse_sets(&set)?)?;
            let policy_name = policy.unwrap_or_else(|| if name == "hanabi" { "rule" } else { "random" }.to_string());
            let mut policy = registry.make_policy(&policy_name)?;
            let stdin = std::io::stdin();
            let mut input = stdin.lock();
            let mut output = std::io::stdout().lock();
            let result = runner::play_interactive(env.as_mut(), seat, policy.as_mut(), seed, &mut input, &mut output)?;
            output.flush()?;
            eprintln!("{}", serde_json::to_string(&result)?);
            Ok(())
        }
        EnvCommand::Bench { name, episodes, seed, policy, set } => {
            check_episodes(episodes)?;
            let policy = policy.unwrap_or_else(|| if name == "coding" { "canonical" } else { "random" }.to_string());
            let mut env = registry.make(&name, &parse_sets(&set)?)?;
            let mut policy = registry.make_policy(&policy)?;
            tracing::info!(env = %name, episodes, seed, policy = policy.name(), "benchmarking");
            let report = runner::bench(env.as_mut(), policy.as_mut(), episodes, seed)?;
            super::output::emit(serde_json::to_string_pretty(&report)?)?;
            Ok(())
        }
        EnvCommand::Record { name, episodes, seed, policy, set, out, force } => {
            check_episodes(episodes)?;
            if out.is_dir() {
                bail!("--out {} is a directory; give a file name", out.display());
            }
            if !force && std::fs::symlink_metadata(&out).is_ok() {
                bail!("--out {} already exists; give a new file name, or --force to replace it", out.display());
            }
            let mut policy = registry.make_policy(&policy)?;
            let lines = records::record_episodes(registry, &name, &parse_sets(&set)?, episodes, seed, policy.as_mut())?;
            let tmp = out.with_extension("jsonl.tmp");
            let mut text = lines.join("\n");
            text.push('\n');
            std::fs::write(&tmp, text).with_context(|| format!("cannot write {}", tmp.display()))?;
            std::fs::rename(&tmp, &out)
                .with_context(|| format!("cannot move {} to {}", tmp.display(), out.display()))?;
            tracing::info!(games = lines.len(), out = %out.display(), "recorded");
            Ok(())
        }
        EnvCommand::Replay { files } => {
            let mut report = records::ReplayReport::default();
            for file in &files {
                let one = records::replay_file(file)?;
                if one.passed + one.failed == 0 {
                    bail!("{}: no game records in the file", file.display());
                }
                report.merge(one);
            }
            for failure in &report.failures {
                eprintln!("FAILED {failure}");
            }
            super::output::emit(format_args!("{} passed, {} failed", report.passed, report.failed))?;
            if report.failed > 0 {
                bail!("{} of {} records did not replay", report.failed, report.passed + report.failed);
            }
            Ok(())
        }
    }
}

/// `--episodes` of `env bench` / `env record`: at least 1, and few enough to hold in memory.
fn check_episodes(episodes: usize) -> anyhow::Result<()> {
    let limit = crate::rl::config::validate::MAX_EPISODES;
    if episodes == 0 {
        bail!("--episodes 0: give at least 1 episode");
    }
    if episodes > limit {
        bail!("--episodes {episodes} is too large (at most {limit})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_parse_as_yaml_scalars() {
        let params = parse_sets(&[
            "players=3".into(),
            "variant=small".into(),
            "random_start_player=true".into(),
            "deal=\"N:...\"".into(),
        ])
        .expect("valid");
        assert_eq!(
            params,
            serde_json::json!({"players": 3, "variant": "small", "random_start_player": true, "deal": "N:..."})
        );
        assert!(parse_sets(&["players".into()]).unwrap_err().to_string().contains("KEY=VALUE"));
        assert!(parse_sets(&["=3".into()]).unwrap_err().to_string().contains("key is empty"));
    }
}
