//! Checks of a run's config against the model it will train, made before the run directory is
//! created, so that a value that cannot work fails at once instead of leaving a run that stops
//! at its first rollout and cannot resume: a reply budget beyond the model's context, or
//! prompts that with that budget do not fit in it.

use std::path::Path;

use troupe_envs::Registry;

use super::TrainConfig;
use crate::error::{Result, TroupeError};
use crate::model::Model;
use crate::rl::rollout::prompt_text;

/// Start states sampled to measure prompt lengths (the run's seed and the ones after it).
const SAMPLED_STARTS: u64 = 4;

/// Refuses a config whose `action.max_new_tokens`, or whose first prompts plus that many new
/// tokens, exceed `model`'s `max_position_embeddings`. Errors name `origin` and the key.
pub fn check_against_model(config: &TrainConfig, origin: &Path, model: &Model, registry: &Registry) -> Result<()> {
    let context = model.lm.config.max_position_embeddings;
    let budget = config.action.max_new_tokens;
    let fail = |key: &str, message: String| TroupeError::BadValue {
        origin: Some(origin.to_path_buf()),
        key: key.to_string(),
        message,
    };
    if budget >= context {
        return Err(fail(
            "action.max_new_tokens",
            format!(
                "{budget} new tokens do not fit in the model's context of {context} tokens (max_position_embeddings)"
            ),
        ));
    }
    // A rank above the projections' width adds no capacity, and its factors could not be
    // allocated for a large model.
    let hidden = model.lm.config.hidden_size;
    if config.adapter.r > hidden {
        return Err(fail(
            "adapter.r",
            format!(
                "{} is larger than the model's hidden size ({hidden}); a LoRA rank above it adds nothing",
                config.adapter.r
            ),
        ));
    }
    let chat_template = config.action.chat_template;
    let mut env = config.build_env(origin, registry)?;
    let mut longest = (0usize, 0u64);
    for offset in 0..SAMPLED_STARTS {
        let seed = config.run.seed.wrapping_add(offset);
        env.reset(seed);
        for seat in env.acting_seats() {
            let text = prompt_text(model, env.as_ref(), seat, chat_template, None)?;
            let tokens = model.tokenizer.encode(&text)?.len();
            if tokens > longest.0 {
                longest = (tokens, seed);
            }
        }
    }
    let (prompt, seed) = longest;
    if prompt + budget > context {
        return Err(fail(
            "action.max_new_tokens",
            format!(
                "the environment's first prompt (seed {seed}) is {prompt} tokens, which with {budget} new tokens exceeds \
                 the model's context of {context} tokens (max_position_embeddings); lower action.max_new_tokens or use a \
                 model with a longer context"
            ),
        ));
    }
    Ok(())
}
