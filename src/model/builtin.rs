//! The built-in default model: a Qwen3-architecture model initialised from a seed, with a
//! byte-level BPE tokenizer trained on an embedded corpus (no download). `troupe init-model`
//! writes it as a Hugging Face directory that transformers loads as it is.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use tokenizers::models::bpe::{BpeTrainer, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use super::config::{ModelConfig, ModelType};
use super::safetensors_io::{write_f32_tensors, F32Tensor, HostTensor, StoredFloat};
use super::tokenizer::TextTokenizer;
use super::weights::MemoryWeights;
use crate::error::{ModelError, Result, TroupeError};
use crate::fsutil::write_atomic;

/// Text the built-in tokenizer's merges are learned from: game talk, prose and Python.
const CORPUS: &str = include_str!("corpus.txt");

/// Special tokens, in id order (0, 1, 2), as Qwen-style chat models use them.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Most ids the tokenizer may use (specials + 256 bytes + merges); training stops earlier when
/// the corpus has no pair left that occurs twice. The tiny preset's vocabulary has this size.
pub const TOKENIZER_SIZE: usize = 1024;

/// The vocabulary size of every Qwen3 model (`config.json`'s `vocab_size`).
const QWEN3_VOCAB: usize = 151_936;

/// ChatML, the template Qwen models use.
pub const CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Sizes of the built-in model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// About 0.9M parameters: trains in minutes on 2 CPU cores.
    Tiny,
    /// 41.6M parameters: exactly the Qwen3 shape of `peer_bench.py --make-small`.
    Small,
    /// Qwen3-0.6B's published shape (0.60B parameters, 0.44B without the embedding).
    #[value(name = "qwen3-0.6b")]
    Qwen3_0_6b,
    /// Qwen3-1.7B's published shape (1.72B parameters, 1.41B without the embedding).
    #[value(name = "qwen3-1.7b")]
    Qwen3_1_7b,
    /// Qwen3-4B's published shape (4.02B parameters, 3.63B without the embedding).
    #[value(name = "qwen3-4b")]
    Qwen3_4b,
}

impl Preset {
    /// The model configuration of this preset. The `qwen3-*` presets take every shape field of
    /// the published `config.json` (vocabulary 151936, rope_theta 1e6, tied embeddings); only
    /// the EOS id differs, as the built-in tokenizer's ids are small.
    pub fn config(self) -> ModelConfig {
        let (vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, max_pos) = match self {
            Preset::Tiny => (TOKENIZER_SIZE, 128, 384, 4, 4, 2, 32, 4096),
            Preset::Small => (32000, 512, 1536, 8, 8, 4, 64, 40960),
            Preset::Qwen3_0_6b => (QWEN3_VOCAB, 1024, 3072, 28, 16, 8, 128, 40960),
            Preset::Qwen3_1_7b => (QWEN3_VOCAB, 2048, 6144, 28, 16, 8, 128, 40960),
            Preset::Qwen3_4b => (QWEN3_VOCAB, 2560, 9728, 36, 32, 8, 128, 40960),
        };
        ModelConfig {
            model_type: ModelType::Qwen3,
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: intermediate,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            max_position_embeddings: max_pos,
            tie_word_embeddings: true,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            eos_token_ids: vec![0],
        }
    }
}

/// Trains the built-in byte-level BPE tokenizer on the embedded corpus (deterministic).
pub fn build_tokenizer() -> Result<Tokenizer> {
    let origin = PathBuf::from("<built-in tokenizer>");
    let error = |e: tokenizers::Error| {
        TroupeError::Model(ModelError::Tokenizer { path: origin.clone(), message: e.to_string() })
    };
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, false, true)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    let specials: Vec<AddedToken> = SPECIAL_TOKENS.iter().map(|t| AddedToken::from(*t, true)).collect();
    let mut trainer: TrainerWrapper = BpeTrainer::builder()
        .vocab_size(TOKENIZER_SIZE)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(specials.clone())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    tokenizer.train(&mut trainer, CORPUS.lines()).map_err(error)?;
    tokenizer.add_special_tokens(&specials);
    Ok(tokenizer)
}

/// The built-in tokenizer with its EOS ids (`<|im_end|>`, `<|endoftext|>`) and chat template.
pub fn builtin_tokenizer() -> Result<TextTokenizer> {
    let mut tokenizer =
        TextTokenizer::from_parts(build_tokenizer()?, PathBuf::from("<built-in tokenizer>"), vec![2, 0]);
    tokenizer.chat_template = Some(CHAT_TEMPLATE.to_string());
    Ok(tokenizer)
}

/// How one tensor of a built-in model is drawn.
enum Draw {
    /// From a normal distribution of this standard deviation, by this generator's state.
    Normal { std: f32, from: Box<ChaCha8Rng> },
    /// All ones (the norms' weights).
    Ones,
}

/// One tensor of a built-in model: its name, its shape and how its values are drawn.
struct Planned {
    name: String,
    shape: Vec<usize>,
    draw: Draw,
}

impl Planned {
    fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// The tensor's values: the same on every call.
    fn values(&self) -> Vec<f32> {
        match &self.draw {
            Draw::Normal { std, from } => draw_normal(*std, self.len(), &mut ChaCha8Rng::clone(from)),
            Draw::Ones => vec![1.0; self.len()],
        }
    }
}

/// The tensors of `config`'s random weights in the order the generator draws them: each one's
/// name, shape, and the standard deviation of its normal values (`None`: all ones, the norms).
/// The blocks get std 0.02 like transformers' `initializer_range`.
fn layout(config: &ModelConfig) -> Vec<(String, Vec<usize>, Option<f32>)> {
    let (h, v) = (config.hidden_size, config.vocab_size);
    // The (tied) embeddings get std 1/sqrt(hidden): a random hidden state then gives logits
    // of std about 1 (a mildly uneven first distribution, like a trained model's spread), and
    // one aligned with a token's embedding can lift it by sqrt(hidden) nats. With the blocks'
    // 0.02, the normalised final state could only ever shift a logit by about 2.5 nats, so no
    // adapter could make the model confident of anything.
    let mut tensors = vec![("model.embed_tokens.weight".to_string(), vec![v, h], Some(1.0 / (h as f32).sqrt()))];
    let i = config.intermediate_size;
    let q = config.num_attention_heads * config.head_dim;
    let kv = config.num_key_value_heads * config.head_dim;
    let mut ones = Vec::new();
    for layer in 0..config.num_hidden_layers {
        let p = format!("model.layers.{layer}");
        for (name, shape) in [
            ("self_attn.q_proj", vec![q, h]),
            ("self_attn.k_proj", vec![kv, h]),
            ("self_attn.v_proj", vec![kv, h]),
            ("self_attn.o_proj", vec![h, q]),
            ("mlp.gate_proj", vec![i, h]),
            ("mlp.up_proj", vec![i, h]),
            ("mlp.down_proj", vec![h, i]),
        ] {
            tensors.push((format!("{p}.{name}.weight"), shape, Some(0.02)));
        }
        ones.push((format!("{p}.input_layernorm.weight"), vec![h], None));
        ones.push((format!("{p}.post_attention_layernorm.weight"), vec![h], None));
        if config.model_type == ModelType::Qwen3 {
            ones.push((format!("{p}.self_attn.q_norm.weight"), vec![config.head_dim], None));
            ones.push((format!("{p}.self_attn.k_norm.weight"), vec![config.head_dim], None));
        }
    }
    ones.push(("model.norm.weight".into(), vec![h], None));
    tensors.extend(ones);
    tensors
}

/// `len` values of a normal distribution of standard deviation `std`, drawn from `rng`.
fn draw_normal(std: f32, len: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    let normal = Normal::new(0.0f32, std).expect("valid std");
    (0..len).map(|_| normal.sample(rng)).collect()
}

/// The tensors of `config`'s random weights (see [`layout`]), drawn in turn from one
/// `ChaCha8Rng` seeded with `seed`: each random tensor keeps the generator's state where its
/// values start, so any tensor's values can be drawn alone, in any order, without holding the
/// others'.
fn plan(config: &ModelConfig, seed: u64) -> Vec<Planned> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let planned = layout(config).into_iter().map(|(name, shape, std)| {
        let draw = match std {
            Some(std) => {
                let from = Box::new(rng.clone());
                // Moves the generator past the tensor's values.
                let normal = Normal::new(0.0f32, std).expect("valid std");
                for _ in 0..shape.iter().product::<usize>() {
                    let _: f32 = normal.sample(&mut rng);
                }
                Draw::Normal { std, from }
            }
            None => Draw::Ones,
        };
        Planned { name, shape, draw }
    });
    planned.collect()
}

/// Random weights for `config`, the ones [`plan`]'s tensors give (drawn once, in turn): the
/// same seed gives the same model.
pub fn init_weights(config: &ModelConfig, seed: u64) -> MemoryWeights {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let tensors = layout(config)
        .into_iter()
        .map(|(name, shape, std)| {
            let len = shape.iter().product();
            let values = match std {
                Some(std) => draw_normal(std, len, &mut rng),
                None => vec![1.0; len],
            };
            (name, HostTensor { values, shape })
        })
        .collect();
    MemoryWeights { tensors }
}

/// Writes the built-in model as a Hugging Face directory: `config.json`,
/// `generation_config.json`, `model.safetensors` (its weights stored as `stored`, rounded from
/// the f32 values drawn), `tokenizer.json`, `tokenizer_config.json`. Every file is written
/// atomically; an existing directory is written into.
pub fn write_model_dir(out: &Path, preset: Preset, seed: u64, stored: StoredFloat) -> Result<()> {
    std::fs::create_dir_all(out).map_err(|e| TroupeError::io(out, e))?;
    let config = preset.config();
    let tokenizer = build_tokenizer()?;
    let json = |value: &serde_json::Value| serde_json::to_vec_pretty(value).expect("JSON values serialize");
    let tokenizer_json = tokenizer.to_string(true).map_err(|e| {
        TroupeError::Model(ModelError::Tokenizer { path: out.join("tokenizer.json"), message: e.to_string() })
    })?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    // Each tensor is drawn as the file reaches it: `qwen3-4b`'s 16 GB are written holding one
    // tensor's values and their bytes (the 1.6 GB embedding's, at most), not the model.
    let tensors = plan(&config, seed).into_iter().map(|t| {
        let shape = t.shape.clone();
        (t.name.clone(), F32Tensor::new(shape, move || Cow::Owned(t.values())).stored_as(stored))
    });
    write_f32_tensors(&out.join("model.safetensors"), tensors, Some(metadata))?;
    write_atomic(&out.join("tokenizer.json"), tokenizer_json.as_bytes())?;
    write_atomic(
        &out.join("tokenizer_config.json"),
        &json(&serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": null,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": null,
            "model_max_length": config.max_position_embeddings,
            "clean_up_tokenization_spaces": false,
            "chat_template": CHAT_TEMPLATE,
        })),
    )?;
    write_atomic(
        &out.join("generation_config.json"),
        &json(&serde_json::json!({"eos_token_id": [2, 0], "pad_token_id": 0, "do_sample": false})),
    )?;
    let mut hf_config = config.to_hf_json(0);
    for key in ["dtype", "torch_dtype"] {
        hf_config[key] = stored.torch_name().into();
    }
    write_atomic(&out.join("config.json"), &json(&hf_config))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_is_deterministic_and_round_trips() {
        let a = build_tokenizer().unwrap().to_string(false).unwrap();
        let b = build_tokenizer().unwrap().to_string(false).unwrap();
        assert_eq!(a, b);
        let tokenizer = builtin_tokenizer().unwrap();
        assert!((512..=TOKENIZER_SIZE).contains(&tokenizer.vocab_size()), "{}", tokenizer.vocab_size());
        for (id, token) in SPECIAL_TOKENS.iter().enumerate() {
            assert_eq!(tokenizer.token_to_id(token), Some(id as u32));
        }
        let text = "Player 1 hints red. <answer>play card 2</answer> déjà vu";
        let ids = tokenizer.encode(text).unwrap();
        assert!(ids.len() < text.len() / 2, "merges compress the text: {} ids", ids.len());
        assert_eq!(tokenizer.decode(&ids, false).unwrap(), text);
    }

    #[test]
    fn small_preset_has_the_peer_shape() {
        assert_eq!(Preset::Small.config().num_parameters(), 41_559_552);
        assert!(Preset::Tiny.config().num_parameters() < 1_200_000);
    }

    /// The `qwen3-*` presets against the `config.json` files Qwen publishes (fixtures/configs)
    /// and the model cards' parameter counts, without drawing any weights.
    #[test]
    fn published_qwen3_shapes() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/configs");
        // (preset, file, card's parameters, card's non-embedding parameters, in billions, and
        // the decimals the card rounds them to)
        let cards = [
            (Preset::Qwen3_0_6b, "Qwen3-0.6B.json", 0.6, 0.44, 2),
            (Preset::Qwen3_1_7b, "Qwen3-1.7B.json", 1.7, 1.4, 1),
            (Preset::Qwen3_4b, "Qwen3-4B.json", 4.0, 3.6, 1),
        ];
        for (preset, file, total, non_embedding, decimals) in cards {
            let published = ModelConfig::from_file(&dir.join(file)).unwrap();
            let mut ours = preset.config();
            assert_eq!(published.eos_token_ids, vec![151645]);
            ours.eos_token_ids = published.eos_token_ids.clone();
            assert_eq!(ours, published, "{file}");
            let n = ours.num_parameters();
            let embedding = ours.vocab_size * ours.hidden_size;
            let billions = |n: usize, places: i32| {
                let scale = 10f64.powi(places);
                (n as f64 / 1e9 * scale).round() / scale
            };
            assert_eq!(billions(n, 1), total, "{file}: {n} parameters");
            assert_eq!(billions(n - embedding, decimals), non_embedding, "{file}: {n} - {embedding}");
            let by_tensor: usize = ours.tensor_shapes().iter().map(|(_, s)| s.iter().product::<usize>()).sum();
            assert_eq!(by_tensor, n, "{file}");
        }
        assert_eq!(Preset::Qwen3_0_6b.config().num_parameters(), 596_049_920);
        assert_eq!(Preset::Qwen3_1_7b.config().num_parameters(), 1_720_574_976);
        assert_eq!(Preset::Qwen3_4b.config().num_parameters(), 4_022_468_096);
        for name in ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b"] {
            assert!(<Preset as clap::ValueEnum>::from_str(name, true).is_ok(), "{name}");
        }
    }

    /// The weights a preset draws are exactly the checkpoint layout of its configuration
    /// (checked on `tiny`: the real-shape presets draw the same tensors, only larger).
    #[test]
    fn weights_cover_the_checkpoint_layout() {
        let config = Preset::Tiny.config();
        let weights = init_weights(&config, 0);
        let drawn: Vec<(String, Vec<usize>)> =
            weights.tensors.iter().map(|(name, t)| (name.clone(), t.shape.clone())).collect();
        let mut expected = config.tensor_shapes();
        expected.sort();
        assert_eq!(drawn, expected);
    }

    #[test]
    fn weights_depend_only_on_the_seed() {
        let config = Preset::Tiny.config();
        let a = init_weights(&config, 3);
        let b = init_weights(&config, 3);
        let c = init_weights(&config, 4);
        let name = "model.layers.0.self_attn.q_proj.weight";
        assert_eq!(a.tensors[name], b.tensors[name]);
        assert_ne!(a.tensors[name], c.tensors[name]);
    }

    /// `init-model` draws each tensor as the file reaches it, in safetensors' order, not the
    /// order the generator runs in: the file holds the same model as memory, value for value,
    /// or each value rounded to the type it is stored in, which `config.json` names.
    #[test]
    fn the_written_model_is_the_one_in_memory() {
        let memory = init_weights(&Preset::Tiny.config(), 3);
        for (stored, torch) in [(StoredFloat::F32, "float32"), (StoredFloat::Bf16, "bfloat16")] {
            let dir = tempfile::tempdir().unwrap();
            write_model_dir(dir.path(), Preset::Tiny, 3, stored).unwrap();
            let path = dir.path().join("model.safetensors");
            let store =
                super::super::safetensors_io::TensorStore::open_files(std::slice::from_ref(&path), path.clone())
                    .unwrap();
            assert_eq!(store.names(), memory.tensors.keys().cloned().collect::<Vec<_>>());
            for (name, tensor) in &memory.tensors {
                assert_eq!(store.stored_float(name), Some(stored), "{name}");
                let rounded: Vec<f32> = match stored {
                    StoredFloat::Bf16 => tensor.values.iter().map(|v| half::bf16::from_f32(*v).to_f32()).collect(),
                    _ => tensor.values.clone(),
                };
                assert_eq!(store.read(name, Some(&tensor.shape)).unwrap().values, rounded, "{name}");
            }
            let config: serde_json::Value =
                serde_json::from_slice(&std::fs::read(dir.path().join("config.json")).unwrap()).unwrap();
            assert_eq!((&config["dtype"], &config["torch_dtype"]), (&torch.into(), &torch.into()));
        }
    }
}
