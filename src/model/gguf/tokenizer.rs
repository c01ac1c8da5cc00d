//! The tokenizer of a GGUF file, built from its metadata with the `tokenizers` crate: the
//! vocabulary (`tokenizer.ggml.tokens`), merges (`tokenizer.ggml.merges`) and token types
//! (`tokenizer.ggml.token_type`) of a GPT-2-style byte-level BPE (`tokenizer.ggml.model = gpt2`),
//! the pre-tokenizer named by `tokenizer.ggml.pre`, the special ids and the chat template.
//!
//! As transformers' GGUF tokenizer does: a token spelled outside the byte-level alphabet is
//! respelled in it, CONTROL tokens (type 3) become special added tokens and USER_DEFINED ones
//! (type 4) plain added tokens, matched whole in the text. The pre-tokenizer regex follows
//! llama.cpp's `tokenizer.ggml.pre` names (Llama 3, Qwen2, GPT-4o, Tekken families, and GPT-2's
//! for the rest); for `smollm` digits are split one by one first, as SmolLM's own tokenizer and
//! llama.cpp do (transformers 5.23 splits them by GPT-2's rule instead).

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::container::GgufFile;
use crate::error::{ModelError, Result, TroupeError};
use crate::model::TextTokenizer;

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The split regex of a `tokenizer.ggml.pre` name, `None` for GPT-2's own.
fn split_regex(pre: &str) -> Option<&'static str> {
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
        | "jina-v5-nano" | "dbrx" | "smaug-bpe" => LLAMA3_SPLIT,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2_SPLIT,
        "qwen35" => QWEN35_SPLIT,
        "tekken" => TEKKEN_SPLIT,
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => GPT4O_SPLIT,
        _ => return None,
    })
}

/// The pre-tokenizer (as `tokenizer.json` writes it) for a `tokenizer.ggml.pre` name.
fn pre_tokenizer(pre: Option<&str>) -> Value {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    match pre {
        Some(name) if split_regex(name).is_some() => json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": split_regex(name)}, "behavior": "Isolated", "invert": false},
                byte_level(false),
            ],
        }),
        Some("smollm") => json!({
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)],
        }),
        _ => byte_level(true),
    }
}

/// GPT-2's map from bytes to the printable characters byte-level BPE spells them with.
fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    for byte in 0..=255u32 {
        let printable = (33..=126).contains(&byte) || (161..=172).contains(&byte) || (174..=255).contains(&byte);
        table[byte as usize] = if printable {
            char::from_u32(byte).expect("latin-1")
        } else {
            extra += 1;
            char::from_u32(255 + extra).expect("valid code point")
        };
    }
    table
}

/// Token types of llama.cpp's `llama_token_type`.
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// Builds the tokenizer of `file`, with its EOS ids, chat template and BOS/EOS strings.
pub fn read_tokenizer(file: &GgufFile, eos_token_ids: &[u32]) -> Result<TextTokenizer> {
    let model = file
        .string("tokenizer.ggml.model")?
        .ok_or_else(|| file.error("metadata `tokenizer.ggml.model` is missing (the file has no tokenizer)"))?;
    if model != "gpt2" {
        return Err(TroupeError::Model(ModelError::Tokenizer {
            path: file.path().to_path_buf(),
            message: format!(
                "tokenizer.ggml.model {model:?} is not supported (troupe reads GPT-2-style byte-level BPE, \"gpt2\")"
            ),
        }));
    }
    let tokens = file
        .strings("tokenizer.ggml.tokens")?
        .ok_or_else(|| file.error("metadata `tokenizer.ggml.tokens` is missing"))?;
    let merges = file
        .strings("tokenizer.ggml.merges")?
        .ok_or_else(|| file.error("metadata `tokenizer.ggml.merges` is missing"))?;
    let types = file.ints("tokenizer.ggml.token_type")?.unwrap_or_default();
    if !types.is_empty() && types.len() != tokens.len() {
        return Err(file.error(format!(
            "metadata `tokenizer.ggml.token_type` has {} entries for {} tokens",
            types.len(),
            tokens.len()
        )));
    }
    let spelling = bytes_to_unicode();
    let alphabet: std::collections::HashSet<char> = spelling.iter().copied().collect();
    let in_alphabet = |token: &str| token.chars().all(|c| alphabet.contains(&c));
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    for (id, token) in tokens.iter().enumerate() {
        let spelled =
            if in_alphabet(token) { token.to_string() } else { token.bytes().map(|b| spelling[b as usize]).collect() };
        vocab.insert(spelled, json!(id));
    }
    let mut added = Vec::new();
    for (id, (token, &kind)) in tokens.iter().zip(&types).enumerate() {
        // A CONTROL token spelled outside the byte alphabet is a mislabel in a byte-level
        // vocabulary; transformers skips it, and so does troupe.
        let special = kind == CONTROL && in_alphabet(token);
        let user = kind == USER_DEFINED && vocab.contains_key(*token);
        if special || user {
            added.push(json!({
                "id": id, "content": token, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": special,
            }));
        }
    }
    let pre = file.string("tokenizer.ggml.pre")?;
    let document = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer(pre),
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        },
    });
    let bytes = serde_json::to_vec(&document).expect("a JSON value serializes");
    let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
        TroupeError::Model(ModelError::Tokenizer {
            path: file.path().to_path_buf(),
            message: format!("cannot build the BPE tokenizer from the metadata: {e}"),
        })
    })?;
    let token_of = |key: &str| -> Result<Option<String>> {
        Ok(match file.uint(key)? {
            Some(id) => Some(
                tokens
                    .get(id as usize)
                    .ok_or_else(|| {
                        file.error(format!("metadata `{key}` {id} is outside the vocabulary of {}", tokens.len()))
                    })?
                    .to_string(),
            ),
            None => None,
        })
    };
    let bos = token_of("tokenizer.ggml.bos_token_id")?;
    let eos = token_of("tokenizer.ggml.eos_token_id")?;
    token_of("tokenizer.ggml.padding_token_id")?;
    for &id in eos_token_ids {
        if id as usize >= tokens.len() {
            return Err(file.error(format!("end-of-sequence id {id} is outside the vocabulary of {}", tokens.len())));
        }
    }
    let template = file.string("tokenizer.chat_template")?.map(str::to_string);
    Ok(TextTokenizer::from_parts(inner, file.path().to_path_buf(), eos_token_ids.to_vec())
        .with_chat_template(template, bos, eos))
}

/// The special ids a GGUF file names (for `troupe model inspect`).
pub fn special_ids(file: &GgufFile) -> Result<BTreeMap<&'static str, u64>> {
    let mut ids = BTreeMap::new();
    for (name, key) in [
        ("bos", "tokenizer.ggml.bos_token_id"),
        ("eos", "tokenizer.ggml.eos_token_id"),
        ("eot", "tokenizer.ggml.eot_token_id"),
        ("pad", "tokenizer.ggml.padding_token_id"),
        ("unk", "tokenizer.ggml.unknown_token_id"),
    ] {
        if let Some(id) = file.uint(key)? {
            ids.insert(name, id);
        }
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_is_gpt2s() {
        let table = bytes_to_unicode();
        assert_eq!(table[b' ' as usize], 'Ġ');
        assert_eq!(table[b'\n' as usize], 'Ċ');
        assert_eq!(table[b'a' as usize], 'a');
        let distinct: std::collections::HashSet<char> = table.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }
}
