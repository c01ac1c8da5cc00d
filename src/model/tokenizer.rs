//! The text side of a model: `tokenizer.json` through the `tokenizers` crate, end-of-sequence ids
//! from `generation_config.json` / `config.json`, and the chat template from
//! `tokenizer_config.json`, rendered with `minijinja` as transformers renders it with Jinja.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::config::parse_token_ids;
use crate::error::{ModelError, Result, TroupeError};

/// One chat message (`{"role": ..., "content": ...}`), as chat templates expect.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role.
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        Self { role: role.to_string(), content: content.into() }
    }
}

/// A tokenizer with the model's special ids and chat template.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    /// Where it was loaded from (for messages).
    origin: PathBuf,
    /// Ids that end a generation.
    pub eos_token_ids: Vec<u32>,
    /// The Jinja chat template, when the model has one.
    pub chat_template: Option<String>,
    /// `bos_token` / `eos_token` strings for the template.
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("origin", &self.origin)
            .field("vocab", &self.inner.get_vocab_size(true))
            .field("eos_token_ids", &self.eos_token_ids)
            .finish()
    }
}

/// Reads a JSON file if it exists.
fn read_optional_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| TroupeError::io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TroupeError::Json { path: path.to_path_buf(), message: e.to_string() })
}

/// A special-token field of `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_string(value: Option<&serde_json::Value>) -> Option<String> {
    match value? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(map) => map.get("content").and_then(|c| c.as_str()).map(str::to_string),
        _ => None,
    }
}

impl TextTokenizer {
    /// Loads `tokenizer.json` (required) plus `tokenizer_config.json` and
    /// `generation_config.json` (optional) from a model directory. `config_eos` are the EOS ids
    /// of `config.json`.
    pub fn from_model_dir(dir: &Path, config_eos: &[u32]) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|e| TroupeError::io(&path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| TroupeError::Model(ModelError::Tokenizer { path: path.clone(), message: e.to_string() }))?;
        let tokenizer_config = read_optional_json(&dir.join("tokenizer_config.json"))?;
        let generation_config = read_optional_json(&dir.join("generation_config.json"))?;
        let mut eos: Vec<u32> =
            generation_config.as_ref().and_then(|g| parse_token_ids(g.get("eos_token_id"))).unwrap_or_default();
        for id in config_eos {
            if !eos.contains(id) {
                eos.push(*id);
            }
        }
        let mut tokenizer = Self::from_parts(inner, path, eos);
        if let Some(config) = tokenizer_config {
            tokenizer.chat_template = config.get("chat_template").and_then(|t| t.as_str()).map(str::to_string);
            if let Some(bos) = token_string(config.get("bos_token")) {
                tokenizer.bos_token = bos;
            }
            if let Some(eos_token) = token_string(config.get("eos_token")) {
                if let Some(id) = tokenizer.inner.token_to_id(&eos_token) {
                    if !tokenizer.eos_token_ids.contains(&id) {
                        tokenizer.eos_token_ids.push(id);
                    }
                }
                tokenizer.eos_token = eos_token;
            }
        }
        Ok(tokenizer)
    }

    /// Wraps an in-memory tokenizer.
    pub fn from_parts(inner: tokenizers::Tokenizer, origin: PathBuf, eos_token_ids: Vec<u32>) -> Self {
        let eos_token = eos_token_ids.first().and_then(|id| inner.id_to_token(*id)).unwrap_or_default();
        Self { inner, origin, eos_token_ids, chat_template: None, bos_token: String::new(), eos_token }
    }

    /// Sets the chat template and the `bos_token` / `eos_token` strings it renders (a `None`
    /// string keeps the current one).
    pub fn with_chat_template(
        mut self,
        template: Option<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Self {
        self.chat_template = template;
        if let Some(bos) = bos_token {
            self.bos_token = bos;
        }
        if let Some(eos) = eos_token {
            self.eos_token = eos;
        }
        self
    }

    /// The `bos_token` string the chat template sees (empty when the model names none).
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The `eos_token` string the chat template sees.
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Number of ids the tokenizer uses (with added tokens).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Encodes text without adding special tokens (special tokens written in the text, such as
    /// `<|im_start|>`, are still recognised).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.inner.encode(text, false).map(|e| e.get_ids().to_vec()).map_err(|e| {
            TroupeError::Model(ModelError::Tokenizer { path: self.origin.clone(), message: e.to_string() })
        })
    }

    /// Decodes ids to text, dropping special tokens when `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(|e| {
            TroupeError::Model(ModelError::Tokenizer { path: self.origin.clone(), message: e.to_string() })
        })
    }

    /// Whether `id` ends a generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_token_ids.contains(&id)
    }

    /// Renders `messages` with the model's chat template (`add_generation_prompt` appends the
    /// assistant's turn header), or `None` when the model has no template.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<Option<String>> {
        let Some(template) = &self.chat_template else { return Ok(None) };
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, message))
        });
        let error = |e: minijinja::Error| TroupeError::Model(ModelError::ChatTemplate { message: e.to_string() });
        env.add_template("chat", template).map_err(error)?;
        let rendered = env
            .get_template("chat")
            .map_err(error)?
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.clone(),
                eos_token => self.eos_token.clone(),
            })
            .map_err(error)?;
        Ok(Some(rendered))
    }
}
