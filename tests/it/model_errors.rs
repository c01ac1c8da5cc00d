//! Bad model directories give one clear error naming the file, field or tensor.

use crate::common;

use std::path::{Path, PathBuf};

use burn::tensor::Device;
use troupe::model::Model;

/// A writable copy of the tiny-llama fixture (untied lm_head, f32 weights).
fn copy_fixture(dir: &Path) -> PathBuf {
    let src = common::models_dir().join("tiny-llama");
    let dst = dir.join("model");
    std::fs::create_dir_all(&dst).unwrap();
    for name in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(name), dst.join(name)).unwrap();
    }
    dst
}

fn load_error(dir: &Path) -> String {
    Model::from_path(dir, &Device::flex()).expect_err("loading must fail").to_string()
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut json);
    std::fs::write(path, serde_json::to_string(&json).unwrap()).unwrap();
}

#[test]
fn missing_config_and_fields_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture(tmp.path());
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let err = load_error(&dir);
    assert!(err.contains("config.json") && err.contains("No such file"), "{err}");

    let dir = copy_fixture(&tmp.path().join("b"));
    edit_config(&dir, |c| {
        c.as_object_mut().unwrap().remove("num_hidden_layers");
    });
    let err = load_error(&dir);
    assert!(err.contains("config.json") && err.contains("num_hidden_layers: missing"), "{err}");

    edit_config(&dir, |c| c["num_hidden_layers"] = serde_json::json!("two"));
    let err = load_error(&dir);
    assert!(err.contains("config.json") && err.contains("invalid type"), "{err}");
}

#[test]
fn unsupported_model_type_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture(tmp.path());
    edit_config(&dir, |c| c["model_type"] = serde_json::json!("mistral"));
    let err = load_error(&dir);
    assert!(err.contains("unsupported model_type \"mistral\""), "{err}");
}

#[test]
fn missing_or_misshapen_tensors_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture(tmp.path());
    common::edit_safetensors(&dir.join("model.safetensors"), |t| {
        t.remove("model.layers.1.mlp.up_proj.weight");
    });
    let err = load_error(&dir);
    assert!(err.contains("tensor `model.layers.1.mlp.up_proj.weight` is missing"), "{err}");

    let dir = copy_fixture(&tmp.path().join("b"));
    common::edit_safetensors(&dir.join("model.safetensors"), |t| {
        let w = t.get_mut("model.layers.0.mlp.gate_proj.weight").unwrap();
        w.shape = vec![w.shape[1], w.shape[0]];
    });
    let err = load_error(&dir);
    assert!(err.contains("`model.layers.0.mlp.gate_proj.weight` has shape [64, 160], expected [160, 64]"), "{err}");
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn truncated_safetensors_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture(tmp.path());
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_error(&dir);
    assert!(err.contains("model.safetensors") && err.contains("truncated"), "{err}");
}

#[test]
fn sharded_checkpoint_loads_like_a_single_file() {
    use troupe::model::safetensors_io::{write_safetensors, TensorStore};
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture(tmp.path());
    let path = dir.join("model.safetensors");
    let store = TensorStore::open_files(std::slice::from_ref(&path), path.clone()).unwrap();
    let names = store.names();
    let (first, second) = names.split_at(names.len() / 2);
    let mut weight_map = serde_json::Map::new();
    for (shard, part) in [("model-00001-of-00002.safetensors", first), ("model-00002-of-00002.safetensors", second)] {
        let tensors = part.iter().map(|n| (n.clone(), store.read(n, None).unwrap())).collect();
        write_safetensors(&dir.join(shard), &tensors, None).unwrap();
        for n in part {
            weight_map.insert(n.clone(), serde_json::json!(shard));
        }
    }
    std::fs::remove_file(&path).unwrap();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string(&serde_json::json!({"metadata": {}, "weight_map": weight_map})).unwrap(),
    )
    .unwrap();
    let device = Device::flex();
    let sharded = Model::from_path(&dir, &device).unwrap();
    let single = Model::from_path(&common::models_dir().join("tiny-llama"), &device).unwrap();
    let ids = single.tokenizer.encode("Player 1 hints red.").unwrap();
    let a = troupe::generate::score_rows(&sharded.lm, std::slice::from_ref(&ids), None).unwrap();
    let b = troupe::generate::score_rows(&single.lm, &[ids], None).unwrap();
    assert_eq!(a, b);
}

/// `Model::read_config` (what `adapters merge` reads instead of the whole base) gives the
/// configuration a load gives, for every fixture directory and GGUF file, and refuses a bad
/// path with the load's error.
#[test]
fn a_models_configuration_is_read_without_its_weights() {
    let gguf = common::repo_dir().join("fixtures/gguf");
    let paths: Vec<PathBuf> = common::fixture_models()
        .into_iter()
        .chain(["tiny-llama", "tiny-qwen2", "tiny-qwen3"].map(|name| gguf.join(format!("{name}.gguf"))))
        .collect();
    for path in &paths {
        let loaded = Model::from_path(path, &Device::flex()).unwrap();
        assert_eq!(Model::read_config(path).unwrap(), loaded.lm.config, "{}", path.display());
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture(tmp.path());
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert!(Model::read_config(&dir).is_ok(), "no weights are read");
    for bad in [tmp.path().join("missing"), dir.join("tokenizer.json")] {
        let err = Model::read_config(&bad).unwrap_err().to_string();
        assert_eq!(err, load_error(&bad), "{}", bad.display());
        assert!(err.contains(&bad.display().to_string()), "{err}");
    }
}
