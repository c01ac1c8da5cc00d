//! `free` mode: generate text, parse it with the environment's parser; an invalid reply costs
//! the penalty and falls back as configured.

use rand_chacha::ChaCha8Rng;
use troupe_envs::{ActionError, Environment};

use super::action::{random_legal, row_seeds, Decided, Decider, Fallback, Pending, Step};
use super::prompt_text;
use crate::error::{Result, TroupeError};
use crate::generate::generate_rows;
use crate::model::ProjectionDelta;

/// The `free` action mode.
pub struct Free;

impl Decider for Free {
    fn needs_finite_actions(&self) -> bool {
        false
    }

    /// `free` mode: one batched generation for all rows; invalid replies handled per the fallback.
    fn decide(
        &self,
        step: &Step<'_>,
        envs: &[Box<dyn Environment>],
        pending: &[Pending],
        rngs: &mut [ChaCha8Rng],
    ) -> Result<Vec<Decided>> {
        let mut prompts: Vec<Vec<u32>> = pending.iter().map(|p| p.prompt_ids.clone()).collect();
        let mut decided: Vec<Option<Decided>> = (0..pending.len()).map(|_| None).collect();
        let mut todo: Vec<usize> = (0..pending.len()).collect();
        let retries = if step.action.fallback == Fallback::Retry { step.action.max_retries } else { 0 };
        for attempt in 0..=retries {
            let rows: Vec<Option<usize>> = todo.iter().map(|&r| Some(pending[r].agent)).collect();
            let (delta, _) = step.manager.mixed(&rows, false)?;
            let options = step.action.reply_options();
            let seeds = row_seeds(pending, todo.iter().copied(), rngs);
            let batch: Vec<Vec<u32>> = todo.iter().map(|&r| prompts[r].clone()).collect();
            let outputs = generate_rows(
                &step.model.lm,
                &step.model.tokenizer.eos_token_ids,
                &batch,
                &[],
                &options,
                &seeds,
                Some(&delta as &dyn ProjectionDelta),
            )?;
            let mut still = Vec::new();
            for (&r, out) in todo.iter().zip(outputs) {
                let p = &pending[r];
                let text = step.model.tokenizer.decode(&out.output_ids, true)?;
                match envs[p.episode].parse_action(p.seat, &text) {
                    Ok(action) => {
                        decided[r] = Some(Decided {
                            action: Some(action),
                            retry_prompt: (attempt > 0).then(|| prompts[r].clone()),
                            completion_ids: out.output_ids,
                            sampling_logprobs: out.logprobs,
                            invalid: attempt > 0,
                            choice: None,
                        })
                    }
                    Err(ActionError::Failed(message)) => {
                        return Err(TroupeError::env_step(envs[p.episode].name(), message));
                    }
                    Err(err) if attempt < retries => {
                        let note = format!("Your reply {text:?} was not a legal action: {err}. Answer again.");
                        let prompt = prompt_text(
                            step.model,
                            envs[p.episode].as_ref(),
                            p.seat,
                            step.action.chat_template,
                            Some(&note),
                        )?;
                        prompts[r] = step.model.tokenizer.encode(&prompt)?;
                        still.push(r);
                    }
                    Err(_) => {
                        let action = match step.action.fallback {
                            Fallback::EndEpisode => None,
                            Fallback::Random | Fallback::Retry => {
                                random_legal(envs[p.episode].as_ref(), p.seat, &mut rngs[p.episode])
                            }
                        };
                        decided[r] = Some(Decided {
                            action,
                            retry_prompt: (attempt > 0).then(|| prompts[r].clone()),
                            completion_ids: out.output_ids,
                            sampling_logprobs: out.logprobs,
                            invalid: true,
                            choice: None,
                        });
                    }
                }
            }
            todo = still;
            if todo.is_empty() {
                break;
            }
        }
        Ok(decided.into_iter().map(|d| d.expect("every row is decided by the last attempt")).collect())
    }
}
