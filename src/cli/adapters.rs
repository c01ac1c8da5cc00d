//! `troupe adapters inspect|merge` and the `--adapter DIR[:NAME]` option of the model commands.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde_json::json;

use crate::adapters::config::AdapterConfig;
use crate::adapters::merge::{merge_into_model_dir, MergedDtype};
use crate::adapters::peft::{read_adapter_dir, Manifest, CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE};
use crate::adapters::{LoraAdapter, MixedLora};
use crate::model::safetensors_io::TensorStore;
use crate::model::Model;

/// `troupe adapters` subcommands.
#[derive(Debug, Subcommand)]
pub enum AdaptersCommand {
    /// Print JSON describing a directory of adapters (names, ranks, alphas, targets, parameters).
    Inspect {
        /// A directory written by `save_adapters` or by PEFT (or one adapter's directory).
        dir: PathBuf,
    },
    /// Merge one adapter into its base and write a plain model directory.
    Merge(MergeArgs),
}

/// `troupe adapters merge`.
#[derive(Debug, Args)]
pub struct MergeArgs {
    /// The base model: a Hugging Face directory or a GGUF file.
    #[arg(long)]
    pub model: PathBuf,
    /// The adapter: DIR:NAME (one adapter of a directory of adapters) or an adapter's DIR.
    #[arg(long)]
    pub adapter: String,
    /// Where to write the merged model directory: a new or empty directory (one that is not
    /// empty is refused unless `--force` is given).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace the contents of a non-empty `--out` directory.
    #[arg(long)]
    pub force: bool,
    /// The merged weights' type: auto (each tensor as the base stores it, as PEFT's
    /// `merge_and_unload` keeps it; f32 for a GGUF base), f32, bf16 or f16.
    #[arg(long, value_enum, default_value_t = MergedDtype::Auto)]
    pub dtype: MergedDtype,
}

/// Splits `DIR[:NAME]` (a trailing `:NAME` without a path separator names the adapter).
pub fn split_adapter_spec(spec: &str) -> (PathBuf, Option<String>) {
    match spec.rsplit_once(':') {
        Some((dir, name)) if !dir.is_empty() && !name.is_empty() && !name.contains('/') => {
            (PathBuf::from(dir), Some(name.to_string()))
        }
        _ => (PathBuf::from(spec), None),
    }
}

/// The adapter directories under `dir`, sorted.
fn adapter_subdirs(dir: &Path) -> Result<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join(CONFIG_FILE).exists())
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .collect();
    names.sort();
    Ok(names)
}

/// Resolves `DIR[:NAME]` to one adapter's directory.
pub fn resolve_adapter_dir(spec: &str) -> Result<PathBuf> {
    let (dir, name) = split_adapter_spec(spec);
    if let Some(name) = name {
        let sub = dir.join(&name);
        if !sub.join(CONFIG_FILE).exists() {
            let known = adapter_subdirs(&dir).unwrap_or_default().join(", ");
            bail!("--adapter {spec}: no adapter {name:?} in {} (adapters there: {known})", dir.display());
        }
        return Ok(sub);
    }
    if dir.join(CONFIG_FILE).exists() {
        return Ok(dir);
    }
    match adapter_subdirs(&dir)?.as_slice() {
        [] => bail!("--adapter {spec}: {} holds no adapter ({CONFIG_FILE} not found)", dir.display()),
        [one] => Ok(dir.join(one)),
        many => bail!(
            "--adapter {spec}: {} holds several adapters ({}); pick one with DIR:NAME",
            dir.display(),
            many.join(", ")
        ),
    }
}

/// Loads `--adapter` for `model` and returns the per-row delta for a batch of `rows` rows.
pub fn adapter_delta(spec: Option<&str>, model: &Model, rows: usize) -> Result<Option<MixedLora>> {
    let Some(spec) = spec else { return Ok(None) };
    let dir = resolve_adapter_dir(spec)?;
    let adapter: LoraAdapter = read_adapter_dir(&dir, &model.lm.config, model.lm.device())
        .with_context(|| format!("loading adapter {}", dir.display()))?;
    // The manifest of the directory of adapters this one belongs to records its base.
    if let Some(manifest) = [dir.join(MANIFEST_FILE), dir.parent().map(|p| p.join(MANIFEST_FILE)).unwrap_or_default()]
        .iter()
        .find(|path| path.is_file())
        .and_then(|path| std::fs::read_to_string(path).ok())
        .and_then(|text| serde_json::from_str::<crate::adapters::peft::Manifest>(&text).ok())
    {
        let current = crate::model::fingerprint::base_fingerprint(&model.lm);
        crate::adapters::peft::check_base(&dir, manifest.base_fingerprint.as_deref(), Some(&current));
    }
    Ok(Some(MixedLora::new(&[&adapter], &vec![Some(0); rows], &model.lm.config, model.lm.device())))
}

/// Describes one adapter directory without needing its base model.
fn describe(dir: &Path, name: &str) -> Result<serde_json::Value> {
    let config = AdapterConfig::from_file(&dir.join(CONFIG_FILE))?;
    let weights = dir.join(WEIGHTS_FILE);
    let store = TensorStore::open_files(std::slice::from_ref(&weights), weights.clone())?;
    let parameters: usize =
        store.names().iter().filter_map(|n| store.shape(n)).map(|s| s.iter().product::<usize>()).sum();
    let targets: Vec<&str> = config.target_modules.iter().map(|p| p.module_name()).collect();
    Ok(json!({
        "name": name,
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "scale": config.scale(),
        "use_rslora": config.use_rslora,
        "lora_dropout": config.lora_dropout,
        "target_modules": targets,
        "tensors": store.names().len(),
        "parameters": parameters,
        "base_model_name_or_path": config.base_model_name_or_path,
    }))
}

/// Runs one `troupe adapters` subcommand.
pub fn run(command: AdaptersCommand, device: &burn::tensor::Device) -> Result<()> {
    match command {
        AdaptersCommand::Inspect { dir } => {
            let manifest_path = dir.join(MANIFEST_FILE);
            let manifest: Option<Manifest> = if manifest_path.exists() {
                let text = std::fs::read_to_string(&manifest_path)
                    .with_context(|| format!("reading {}", manifest_path.display()))?;
                Some(serde_json::from_str(&text).with_context(|| format!("{}", manifest_path.display()))?)
            } else {
                None
            };
            let adapters: Vec<serde_json::Value> = if dir.join(CONFIG_FILE).exists() {
                let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("adapter").to_string();
                vec![describe(&dir, &name)?]
            } else {
                let names = adapter_subdirs(&dir)?;
                if names.is_empty() {
                    bail!("{}: no adapter ({CONFIG_FILE} not found here or in a subdirectory)", dir.display());
                }
                names.iter().map(|n| describe(&dir.join(n), n)).collect::<Result<_>>()?
            };
            super::output::emit(json!({"dir": dir, "manifest": manifest, "adapters": adapters}))?;
            Ok(())
        }
        AdaptersCommand::Merge(args) => {
            let dir = resolve_adapter_dir(&args.adapter)?;
            super::out_dir::check_out_dir(&args.out, args.force, &[args.model.as_path(), dir.as_path()])?;
            // The base's configuration alone: the merge reads its weights a tensor at a time.
            let config =
                Model::read_config(&args.model).with_context(|| format!("loading model {}", args.model.display()))?;
            let adapter = read_adapter_dir(&dir, &config, device)
                .with_context(|| format!("loading adapter {}", dir.display()))?;
            merge_into_model_dir(&args.model, &adapter, &args.out, args.dtype, device)
                .with_context(|| format!("writing the merged model to {}", args.out.display()))?;
            super::output::emit(json!({"out": args.out, "adapter": dir, "merged_sites": adapter.pairs.len()}))?;
            Ok(())
        }
    }
}
