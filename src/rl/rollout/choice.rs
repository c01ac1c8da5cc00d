//! `choice` mode: score every legal action's text by its log-likelihood, all rows in one packed
//! pass, and sample one from the softmax of the scores.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use troupe_envs::{Action, Environment};

use super::action::{finite_legal_actions, ActionMode, Decided, Decider, Pending, Step};
use super::ChoiceTurn;
use crate::error::Result;
use crate::generate::choice::score_choices;
use crate::model::ProjectionDelta;

/// The `choice` action mode.
pub struct Choice;

impl Decider for Choice {
    fn needs_finite_actions(&self) -> bool {
        true
    }

    /// `choice` mode: every legal action's text is scored after its row's prompt, all rows in one
    /// packed forward ([`score_choices`]: each prompt read once, its keys and values shared by all
    /// its candidates), and an action is sampled from `softmax(log-likelihood / temperature)` (the
    /// most likely at temperature 0). That distribution is the policy the trainer's choice
    /// objective differentiates.
    fn decide(
        &self,
        step: &Step<'_>,
        envs: &[Box<dyn Environment>],
        pending: &[Pending],
        rngs: &mut [ChaCha8Rng],
    ) -> Result<Vec<Decided>> {
        let mut candidates: Vec<Vec<(u32, Vec<u32>)>> = Vec::with_capacity(pending.len());
        for p in pending {
            let legal = finite_legal_actions(envs, p, ActionMode::Choice)?;
            let mut list = Vec::with_capacity(legal.len());
            for action in legal {
                list.push((action.id, step.model.tokenizer.encode(&action.text)?));
            }
            candidates.push(list);
        }
        let token_lists: Vec<Vec<Vec<u32>>> =
            candidates.iter().map(|l| l.iter().map(|(_, ids)| ids.clone()).collect()).collect();
        let agents: Vec<Option<usize>> = pending.iter().map(|p| Some(p.agent)).collect();
        let (delta, _) = step.manager.mixed(&agents, false)?;
        let decisions: Vec<(&[u32], &[Vec<u32>])> =
            pending.iter().zip(&token_lists).map(|(p, c)| (p.prompt_ids.as_slice(), c.as_slice())).collect();
        let scores =
            score_choices(&step.model.lm, &decisions, step.action.choice_score, Some(&delta as &dyn ProjectionDelta))?;
        let temperature = step.action.temperature as f32;
        let mut decided = Vec::with_capacity(pending.len());
        for (((list, tokens), likelihoods), p) in candidates.into_iter().zip(token_lists).zip(scores).zip(pending) {
            let pick = sample_choice(&likelihoods, temperature, &mut rngs[p.episode]);
            let entropy = choice_entropy(&likelihoods, temperature);
            decided.push(Decided {
                action: Some(Action::Id(list[pick].0)),
                retry_prompt: None,
                completion_ids: tokens[pick].clone(),
                sampling_logprobs: vec![choice_log_prob(&likelihoods, temperature, pick)],
                invalid: false,
                choice: Some(ChoiceTurn { candidates: tokens, chosen: pick, entropy }),
            });
        }
        Ok(decided)
    }
}

/// `log softmax(scores / temperature)[pick]`, the choice policy's log-probability of `pick`
/// as the trainer computes it (`crate::generate::choice::choice_log_policy`: scores are divided
/// only at a positive temperature other than 1).
pub fn choice_log_prob(scores: &[f32], temperature: f32, pick: usize) -> f32 {
    let scale = |v: f32| {
        if temperature > 0.0 && temperature != 1.0 {
            f64::from(v) / f64::from(temperature)
        } else {
            f64::from(v)
        }
    };
    let max = scores.iter().map(|&v| scale(v)).fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = scores.iter().map(|&v| (scale(v) - max).exp()).sum();
    (scale(scores[pick]) - max - sum.ln()) as f32
}

/// Entropy (nats) of `softmax(scores / temperature)` (0 at temperature 0: the policy is greedy).
pub fn choice_entropy(scores: &[f32], temperature: f32) -> f64 {
    if temperature <= 0.0 {
        return 0.0;
    }
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let weights: Vec<f64> = scores.iter().map(|&v| f64::from((v - max) / temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    weights.iter().filter(|w| **w > 0.0).map(|w| -(w / total) * (w / total).ln()).sum()
}

/// Samples an index from `softmax(logliks / temperature)`; the most likely (first on ties) at
/// temperature 0.
pub fn sample_choice(logliks: &[f32], temperature: f32, rng: &mut ChaCha8Rng) -> usize {
    if temperature <= 0.0 {
        return logliks.iter().enumerate().fold(0, |best, (i, &v)| if v > logliks[best] { i } else { best });
    }
    let max = logliks.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let weights: Vec<f64> = logliks.iter().map(|&v| f64::from((v - max) / temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut draw = rng.random::<f64>() * total;
    for (i, w) in weights.iter().enumerate() {
        if draw < *w {
            return i;
        }
        draw -= w;
    }
    weights.len() - 1
}
