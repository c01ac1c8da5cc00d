//! `constrained` mode: decode only token sequences that spell one of the seat's legal actions
//! ([`crate::generate::generate_constrained`]); never invalid, needs a finite action set.

use rand_chacha::ChaCha8Rng;
use troupe_envs::{Action, Environment};

use super::action::{finite_legal_actions, row_seeds, ActionMode, Decided, Decider, Pending, Step};
use crate::error::Result;
use crate::generate::{generate_rows, TokenTrie};
use crate::model::ProjectionDelta;

/// The `constrained` action mode.
pub struct Constrained;

impl Decider for Constrained {
    fn needs_finite_actions(&self) -> bool {
        true
    }

    /// `constrained` mode: one batched generation of all rows, each row restricted to the token
    /// sequences of its seat's legal actions. Each action's text is tokenised on its own (no special
    /// tokens), as `choice` mode scores it, and the model's first EOS id is appended when it has
    /// one: a reply ends the way a free reply does, so the loss also teaches the policy to stop after
    /// an action, and an action whose tokens prefix another's stays reachable (its EOS decides).
    ///
    /// The completion is the decoded tokens (the action's tokens and that EOS). The trainer scores
    /// them with the unmasked model, as any other reply: the loss does not see the mask, so tokens
    /// the trie forced (one legal continuation) are trained like sampled ones. The action is the
    /// legal action whose text was spelled, and such a turn is never invalid.
    fn decide(
        &self,
        step: &Step<'_>,
        envs: &[Box<dyn Environment>],
        pending: &[Pending],
        rngs: &mut [ChaCha8Rng],
    ) -> Result<Vec<Decided>> {
        let eos = step.model.tokenizer.eos_token_ids.first().copied();
        let mut legal_ids = Vec::with_capacity(pending.len());
        let mut tries = Vec::with_capacity(pending.len());
        for p in pending {
            let legal = finite_legal_actions(envs, p, ActionMode::Constrained)?;
            let mut sequences = Vec::with_capacity(legal.len());
            for action in &legal {
                let mut ids = step.model.tokenizer.encode(&action.text)?;
                ids.extend(eos);
                sequences.push(ids);
            }
            tries.push(TokenTrie::new(&sequences, eos)?);
            legal_ids.push(legal.into_iter().map(|a| a.id).collect::<Vec<_>>());
        }
        let agents: Vec<Option<usize>> = pending.iter().map(|p| Some(p.agent)).collect();
        let (delta, _) = step.manager.mixed(&agents, false)?;
        let options = step.action.reply_options();
        let seeds = row_seeds(pending, 0..pending.len(), rngs);
        let prompts: Vec<Vec<u32>> = pending.iter().map(|p| p.prompt_ids.clone()).collect();
        let constraints: Vec<Option<&TokenTrie>> = tries.iter().map(Some).collect();
        let outputs = generate_rows(
            &step.model.lm,
            &step.model.tokenizer.eos_token_ids,
            &prompts,
            &constraints,
            &options,
            &seeds,
            Some(&delta as &dyn ProjectionDelta),
        )?;
        Ok(outputs
            .into_iter()
            .zip(legal_ids)
            .map(|(out, ids)| {
                let picked = out.sequence.expect("a constrained row always completes a sequence");
                Decided {
                    action: Some(Action::Id(ids[picked])),
                    retry_prompt: None,
                    completion_ids: out.output_ids,
                    sampling_logprobs: out.logprobs,
                    invalid: false,
                    choice: None,
                }
            })
            .collect())
    }
}
