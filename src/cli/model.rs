//! `troupe init-model`, `troupe logprobs`, `troupe generate`, `troupe model inspect`: the
//! base-model commands.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use serde_json::json;

use super::adapters::adapter_delta;
use crate::generate::{generate, score_rows, GenerateOptions, SamplingConfig};
use crate::model::safetensors_io::StoredFloat;
use crate::model::{builtin, AttentionKernel, ChatMessage, LoadOptions, Model, Precision, Preset, ProjectionDelta};

/// `troupe init-model`: write the built-in model as a Hugging Face directory.
#[derive(Debug, Args)]
pub struct InitModelArgs {
    /// Directory to write (created if missing; one that is not empty is refused unless
    /// `--force` is given).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace the contents of a non-empty `--out` directory.
    #[arg(long)]
    pub force: bool,
    /// Model size.
    #[arg(long, value_enum, default_value = "tiny")]
    pub preset: Preset,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The type the weights are stored in: f32, or bf16 (half the file, as Qwen publishes its
    /// checkpoints; the f32 values drawn, rounded) or f16.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: StoredFloat,
}

/// The base model of `logprobs` and `generate`, and how it runs.
#[derive(Debug, Args)]
pub struct BaseArgs {
    /// A Hugging Face model directory or a GGUF file (default: the built-in tiny model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Keep the base's matrices quantized (a GGUF file's own block types; Q8_0 for a float
    /// checkpoint) and multiply with them directly: a several times smaller base (CPU only).
    #[arg(long)]
    pub quantized: bool,
    /// Precision of the base's matrices: auto (bf16 on CUDA, f32 on the CPU), bf16, f16, f32.
    #[arg(long, value_enum, default_value = "auto")]
    pub dtype: Precision,
    /// Attention kernel on a GPU (`runtime.attention`): auto, flash, materialized. The CPU runs
    /// its own fused attention whatever this says.
    #[arg(long, value_enum, default_value = "auto")]
    pub attention: AttentionKernel,
}

impl BaseArgs {
    /// Loads the base on `device` with the attention kernel chosen.
    fn load(&self, device: &burn::tensor::Device) -> Result<Model> {
        let options = LoadOptions {
            path: self.model.clone(),
            quantized: self.quantized,
            dtype: self.dtype,
            ..LoadOptions::default()
        };
        let mut model = Model::load(&options, device).with_context(|| match &self.model {
            Some(path) => format!("loading model {}", path.display()),
            None => "building the built-in model".to_string(),
        })?;
        model.lm.set_attention_kernel(self.attention);
        Ok(model)
    }
}

/// `troupe logprobs`: log p(token i+1 | tokens ..= i) for a text.
#[derive(Debug, Args)]
pub struct LogprobsArgs {
    /// The base model and how it runs.
    #[command(flatten)]
    pub base: BaseArgs,
    /// A LoRA adapter: DIR:NAME (one adapter of a directory of adapters) or an adapter's DIR.
    #[arg(long)]
    pub adapter: Option<String>,
    /// The text, encoded without added special tokens.
    #[arg(long)]
    pub text: String,
}

/// `troupe generate`: continue a prompt.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The base model and how it runs.
    #[command(flatten)]
    pub base: BaseArgs,
    /// A LoRA adapter: DIR:NAME (one adapter of a directory of adapters) or an adapter's DIR.
    #[arg(long)]
    pub adapter: Option<String>,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 (the default) decodes greedily.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only the k most likely tokens (0: no limit).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Sampler seed: the same seed gives the same text.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// `troupe model` subcommands.
#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Print JSON describing a model (architecture, parameters, tensor types, memory per mode)
    /// without loading its weights.
    Inspect {
        /// A Hugging Face model directory or a GGUF file.
        path: PathBuf,
    },
}

/// Runs one `troupe model` subcommand.
pub fn run_model(command: ModelCommand) -> Result<()> {
    match command {
        ModelCommand::Inspect { path } => {
            let description =
                crate::model::inspect::describe(&path).with_context(|| format!("inspecting {}", path.display()))?;
            super::output::emit(format_args!("{description}"))?;
            Ok(())
        }
    }
}

/// The name a value is given on the command line (`qwen3-0.6b`, `bf16`).
fn cli_name(value: &impl clap::ValueEnum) -> String {
    value.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default()
}

/// Runs `troupe init-model`.
pub fn init_model(args: InitModelArgs) -> Result<()> {
    super::out_dir::check_out_dir(&args.out, args.force, &[])?;
    builtin::write_model_dir(&args.out, args.preset, args.seed, args.dtype)
        .with_context(|| format!("writing the built-in model to {}", args.out.display()))?;
    let parameters = args.preset.config().num_parameters();
    super::output::emit(
        json!({"out": args.out, "preset": cli_name(&args.preset), "seed": args.seed, "dtype": cli_name(&args.dtype), "parameters": parameters}),
    )?;
    Ok(())
}

/// Runs `troupe logprobs`.
pub fn logprobs(args: LogprobsArgs, device: &burn::tensor::Device) -> Result<()> {
    let model = args.base.load(device)?;
    let input_ids = model.tokenizer.encode(&args.text)?;
    // Before the model runs: attention's memory grows with the square of the token count.
    let context = model.lm.config.max_position_embeddings;
    if input_ids.len() > context {
        anyhow::bail!(
            "--text: {} tokens exceed the model's context of {context} tokens (max_position_embeddings)",
            input_ids.len()
        );
    }
    let delta = adapter_delta(args.adapter.as_deref(), &model, 1)?;
    let delta = delta.as_ref().map(|d| d as &dyn ProjectionDelta);
    let logprobs = if input_ids.len() >= 2 {
        score_rows(&model.lm, std::slice::from_ref(&input_ids), delta)?.remove(0)
    } else {
        Vec::new()
    };
    if let Some(position) = logprobs.iter().position(|value| !value.is_finite()) {
        let source = match (&args.base.model, &args.adapter) {
            (Some(dir), Some(adapter)) => format!("model {} with adapter {adapter}", dir.display()),
            (Some(dir), None) => format!("model {}", dir.display()),
            (None, Some(adapter)) => format!("the built-in model with adapter {adapter}"),
            (None, None) => "the built-in model".to_string(),
        };
        anyhow::bail!(
            "{source} gives a non-finite log-probability ({}) at token {} of {}: its weights hold NaN or infinite values",
            logprobs[position],
            position + 1,
            input_ids.len()
        );
    }
    super::output::emit(json!({"input_ids": input_ids, "logprobs": logprobs}))?;
    Ok(())
}

/// Runs `troupe generate`.
pub fn generate_text(args: GenerateArgs, device: &burn::tensor::Device) -> Result<()> {
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        anyhow::bail!("--temperature must be a finite number >= 0, got {}", args.temperature);
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        anyhow::bail!("--top-p must be in (0, 1], got {}", args.top_p);
    }
    let model = args.base.load(device)?;
    let prompt = if args.chat {
        model
            .tokenizer
            .apply_chat_template(&[ChatMessage::new("user", args.prompt.clone())], true)?
            .context("--chat: the model has no chat template")?
    } else {
        args.prompt.clone()
    };
    let prompt_ids = model.tokenizer.encode(&prompt)?;
    if prompt_ids.is_empty() {
        anyhow::bail!("--prompt encodes to no tokens");
    }
    let context = model.lm.config.max_position_embeddings;
    if prompt_ids.len().saturating_add(args.max_new_tokens) > context {
        anyhow::bail!(
            "--max-new-tokens {}: with the prompt's {} tokens that exceeds the model's context of {context} tokens \
             (max_position_embeddings); at most {} new tokens fit",
            args.max_new_tokens,
            prompt_ids.len(),
            context.saturating_sub(prompt_ids.len())
        );
    }
    let options = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        sampling: SamplingConfig { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p },
        seed: args.seed,
        stop_at_eos: true,
        use_cache: true,
    };
    let delta = adapter_delta(args.adapter.as_deref(), &model, 1)?;
    let delta = delta.as_ref().map(|d| d as &dyn ProjectionDelta);
    let start = Instant::now();
    let out = generate(&model.lm, &model.tokenizer.eos_token_ids, std::slice::from_ref(&prompt_ids), &options, delta)?
        .remove(0);
    let seconds = start.elapsed().as_secs_f64();
    let text = model.tokenizer.decode(&out.output_ids, true)?;
    super::output::emit(json!({
        "prompt_ids": prompt_ids,
        "output_ids": out.output_ids,
        "text": text,
        "finished_by_eos": out.finished_by_eos,
        "tokens_per_second": out.output_ids.len() as f64 / seconds.max(1e-9),
    }))?;
    Ok(())
}
