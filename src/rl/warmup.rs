//! The supervised format warm-up, its own runner: before the first MAGRPO iteration each
//! agent's adapter is trained by next-token cross-entropy to answer its seats' prompts with the
//! text of a uniformly random legal action (then EOS), on states from games played by that
//! random policy. The targets carry no strategy (every legal action is equally likely), only the
//! format, so a model that starts by writing noise (the built-in one, which is random) gets
//! free-mode replies the parser accepts, and with them a learning signal; which actions are
//! good is left to MAGRPO. Needs an environment with finite legal action sets.
//!
//! It reuses the trainer's phases: rows of advantage 1 through the update (MAGRPO's objective,
//! so the loss is the mean negative log-likelihood of the targets) and a fresh optimizer at a
//! constant rate whose moments are discarded afterwards.

use std::collections::BTreeSet;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use troupe_envs::{Action, Environment};

use super::credit::batch::{TrainBatch, TrainRow};
use super::objective::{KlPenalty, Objective, ObjectiveConfig};
use super::optimizer::AgentOptimizers;
use super::rollout::{make_env, prompt_text};
use super::trainer::{label_non_finite, MagrpoTrainer};
use crate::error::{Result, TroupeError};

crate::section::config_section! {
    /// `training.format_warmup:` — supervised warm-up on the action format before the first
    /// iteration: its length, batch and rate.
    pub struct FormatWarmup {
        /// Optimizer steps (0: no warm-up).
        pub steps: usize = 0,
        /// Prompts per step.
        pub batch_size: usize = 16,
        /// AdamW learning rate (constant; its moments are discarded afterwards).
        pub lr: f64 = 1e-3,
    }
}

impl FormatWarmup {
    /// Runs the warm-up on `trainer`'s adapters; returns each step's mean negative
    /// log-likelihood per target token (averaged over agents). Its randomness comes from the
    /// run's stream, so a resumed run repeats it exactly.
    pub fn run(&self, trainer: &mut MagrpoTrainer) -> Result<Vec<f64>> {
        if self.steps == 0 {
            return Ok(Vec::new());
        }
        let config = trainer.config().clone();
        let mut rng = ChaCha8Rng::seed_from_u64(trainer.rng_mut().random());
        let eos = trainer.model.tokenizer.eos_token_ids.first().copied();
        let mut envs: Vec<(Box<dyn Environment>, usize)> = Vec::with_capacity(self.batch_size);
        for _ in 0..self.batch_size.max(1) {
            let mut env = make_env(trainer.registry(), &config.env.spec())?;
            env.reset(rng.random());
            envs.push((env, 0));
        }
        let objective = Objective { config: ObjectiveConfig::default(), kl: KlPenalty::default() };
        let mut optimizers = AgentOptimizers::new(config.training.optimizer.clone(), config.training.max_grad_norm);
        let mut nll = Vec::with_capacity(self.steps);
        for step in 0..self.steps {
            let mut rows = Vec::with_capacity(envs.len());
            for (env, steps) in envs.iter_mut() {
                if env.is_terminal() || *steps >= config.training.max_episode_steps {
                    env.reset(rng.random());
                    *steps = 0;
                }
                let mut actions = Vec::new();
                for seat in env.acting_seats() {
                    let legal = env.legal_actions(seat).filter(|l| !l.is_empty()).ok_or_else(|| {
                        TroupeError::setting(
                            "training.format_warmup.steps",
                            format!("the format warm-up needs finite legal actions; {} has none", env.name()),
                        )
                    })?;
                    let pick = &legal[rng.random_range(0..legal.len())];
                    let prompt = prompt_text(&trainer.model, env.as_ref(), seat, config.action.chat_template, None)?;
                    let mut tokens = trainer.model.tokenizer.encode(&prompt)?;
                    let prompt_len = tokens.len();
                    tokens.extend(trainer.model.tokenizer.encode(&pick.text)?);
                    tokens.extend(eos);
                    rows.push(TrainRow {
                        agent: config.agents.seats[seat],
                        tokens,
                        prompt_len,
                        advantage: 1.0,
                        sampling_logprobs: Vec::new(),
                        choice: None,
                        reference_logprobs: None,
                    });
                    actions.push(Action::Id(pick.id));
                }
                env.step(&actions).map_err(|e| TroupeError::env_step(env.name(), format!("format warm-up: {e}")))?;
                *steps += 1;
            }
            let agents = rows.iter().map(|r| r.agent).collect::<BTreeSet<_>>().len().max(1);
            let place = format!("format warm-up step {}", step + 1);
            let batch = TrainBatch { rows };
            let pass = trainer
                .scorer()
                .gradients(&batch, &objective, rng.random())
                .map_err(|e| label_non_finite(e, &place))?;
            nll.push(pass.loss / agents as f64);
            if (step + 1) % (self.steps / 10).max(1) == 0 || step + 1 == self.steps {
                tracing::info!("format warm-up step {}/{}: nll {:.3}", step + 1, self.steps, pass.loss / agents as f64);
            }
            optimizers.step(&mut trainer.manager, pass.grads, self.lr).map_err(|e| label_non_finite(e, &place))?;
        }
        Ok(nll)
    }
}
