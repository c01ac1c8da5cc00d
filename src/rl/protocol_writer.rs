//! The coding task's inference-only protocols ([`troupe_envs::coding::protocols`]) played by
//! the model's agents: [`AdapterWriter`] answers each round with ONE batched generation whose
//! rows use their agents' adapters.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use troupe_envs::coding::protocols::{
    run_protocol_with, CodingProtocol, ProtocolSetup, ProtocolSummary, ReplyRequest, ReplyWriter, WriterError,
};

use crate::adapters::MultiAdapterManager;
use crate::error::Result;
use crate::generate::{generate, GenerateOptions};
use crate::model::{Model, ProjectionDelta};
use crate::rl::rollout::{chat_prompt, ActionConfig};

/// The model's agents: each round is ONE batched generation whose rows use their agents'
/// adapters, with the rollout's sampling and reply length, prompts in the model's chat template
/// when `action.chat_template`. Each call draws the generation's seed from `rng`.
pub struct AdapterWriter<'a> {
    /// The base model.
    pub model: &'a Model,
    /// The agents' adapters.
    pub manager: &'a MultiAdapterManager,
    /// Sampling, reply length and chat template.
    pub action: &'a ActionConfig,
    /// Seeds each generation.
    pub rng: &'a mut ChaCha8Rng,
}

impl ReplyWriter for AdapterWriter<'_> {
    fn write(&mut self, requests: &[ReplyRequest]) -> std::result::Result<Vec<String>, WriterError> {
        self.write_replies(requests).map_err(|e| Box::new(e) as WriterError)
    }
}

impl AdapterWriter<'_> {
    fn write_replies(&mut self, requests: &[ReplyRequest]) -> Result<Vec<String>> {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let prompts = requests
            .iter()
            .map(|r| {
                self.model.tokenizer.encode(&chat_prompt(self.model, &r.system, &r.user, self.action.chat_template)?)
            })
            .collect::<Result<Vec<_>>>()?;
        let rows: Vec<Option<usize>> = requests.iter().map(|r| Some(r.agent)).collect();
        let (delta, _) = self.manager.mixed(&rows, false)?;
        // The same options as a rollout's free-mode generation.
        let options = GenerateOptions {
            max_new_tokens: self.action.max_new_tokens,
            sampling: self.action.sampling(),
            seed: self.rng.random(),
            stop_at_eos: true,
            use_cache: true,
        };
        let outputs = generate(
            &self.model.lm,
            &self.model.tokenizer.eos_token_ids,
            &prompts,
            &options,
            Some(&delta as &dyn ProjectionDelta),
        )?;
        outputs.iter().map(|out| self.model.tokenizer.decode(&out.output_ids, true)).collect()
    }
}

/// Runs `protocol` with the model's agents (see [`AdapterWriter`]) and summarises it.
pub fn run_protocol(
    model: &Model,
    manager: &MultiAdapterManager,
    setup: &ProtocolSetup<'_>,
    protocol: CodingProtocol,
    action: &ActionConfig,
    rng: &mut ChaCha8Rng,
) -> Result<ProtocolSummary> {
    let mut writer = AdapterWriter { model, manager, action, rng };
    Ok(run_protocol_with(&mut writer, setup, protocol)?.summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::AdapterConfig;
    use crate::model::Preset;
    use burn::tensor::Device;
    use rand::SeedableRng;
    use serde_json::Value;
    use troupe_envs::Registry;

    const SEEDS: [u64; 2] = [3, 11];

    fn spec() -> Value {
        // num_turns 3 in the config: the protocols still play one shot.
        serde_json::json!({"name": "coding", "num_turns": 3})
    }

    fn code_block(code: Option<&str>) -> String {
        match code.map(str::trim).filter(|code| !code.is_empty()) {
            Some(code) => format!("```python\n{code}\n```"),
            None => "(no code)".to_string(),
        }
    }

    fn action() -> ActionConfig {
        ActionConfig { max_retries: 0, max_new_tokens: 6, ..ActionConfig::default() }
    }

    fn model() -> (Model, MultiAdapterManager) {
        let device = Device::flex();
        let model = Model::builtin(Preset::Tiny, 0, &device).unwrap();
        let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
        manager.create_adapters(2, &AdapterConfig::default()).unwrap();
        (model, manager)
    }

    #[test]
    fn model_agents_run_every_protocol_with_consistent_counts_and_reproducibly() {
        let (model, manager) = model();
        let registry = Registry::with_builtins();
        let setup = ProtocolSetup { env_spec: &spec(), registry: &registry, seeds: &SEEDS, seat_agents: &[0, 1] };
        let cfg = action();
        for protocol in CodingProtocol::ALL {
            let run = |seed: u64| {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                let mut writer = AdapterWriter { model: &model, manager: &manager, action: &cfg, rng: &mut rng };
                run_protocol_with(&mut writer, &setup, protocol).unwrap()
            };
            let a = run(7);
            let s = &a.summary;
            assert_eq!(s.protocol, protocol);
            assert_eq!(s.episodes, 2);
            assert_eq!(s.replies, 2 * protocol.replies_per_episode());
            assert!(s.invalid_replies <= s.replies && s.passed <= s.episodes);
            assert_eq!(s.invalid_rate, s.invalid_replies as f64 / s.replies as f64);
            assert_eq!(s.pass_rate, s.passed as f64 / 2.0);
            assert!((0.0..=s.max_reward).contains(&s.mean_reward));
            let level_sum = s.levels.structure + s.levels.syntax + s.levels.tests + s.levels.cooperation;
            assert!((level_sum - s.mean_reward).abs() < 1e-12);
            assert_eq!(a.episodes.iter().map(|e| e.seed).collect::<Vec<_>>(), SEEDS);
            for episode in &a.episodes {
                // Adapters by seat: the helper's rows on agent 0, the main agent's on agent 1.
                assert!(episode.replies.iter().all(|r| r.request.agent == r.request.seat));
                if protocol == CodingProtocol::Sequential {
                    let draft = episode.replies[0].code.as_deref();
                    assert!(episode.replies[1].request.user.contains(&code_block(draft)));
                }
                if protocol == CodingProtocol::Discussion {
                    assert!(episode.replies[3].request.user.contains(&code_block(episode.replies[0].code.as_deref())));
                    assert!(episode.replies[2].request.user.contains(&code_block(episode.replies[1].code.as_deref())));
                }
            }
            assert_eq!(a, run(7), "{protocol}: same seed, same run");
        }
        // run_protocol is the summary of the same run.
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let summary = run_protocol(&model, &manager, &setup, CodingProtocol::Parallel, &cfg, &mut rng).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut writer = AdapterWriter { model: &model, manager: &manager, action: &cfg, rng: &mut rng };
        assert_eq!(summary, run_protocol_with(&mut writer, &setup, CodingProtocol::Parallel).unwrap().summary);
    }
}
