//! Loads a directory of PEFT adapters (as PEFT or troupe wrote it) for a base model and saves it
//! again in troupe's PEFT layout, checking it against the base on the way.
//!
//! `cargo run --example resave_adapters -- MODEL_DIR ADAPTERS_DIR OUT_DIR`

use std::path::PathBuf;

use burn::tensor::Device;
use troupe::adapters::MultiAdapterManager;
use troupe::model::Model;

fn main() -> anyhow::Result<()> {
    let args: Vec<PathBuf> = std::env::args().skip(1).map(PathBuf::from).collect();
    let [model_dir, adapters_dir, out] = args.as_slice() else {
        anyhow::bail!("usage: resave_adapters MODEL_DIR ADAPTERS_DIR OUT_DIR");
    };
    let device = Device::flex();
    let model = Model::from_path(model_dir, &device)?;
    let mut manager = MultiAdapterManager::new(&model.lm.config, &device);
    manager.load_adapters(adapters_dir)?;
    manager.save_adapters(out)?;
    println!("{}", serde_json::json!({"saved": out, "adapters": manager.adapter_names()}));
    Ok(())
}
