//! The integration tests, one module per concern, linked into one test binary: one link of
//! troupe and burn instead of one per file (disk and build time on small CI machines).

mod common;

mod adapters_isolation;
mod adapters_peft;
mod base_model;
mod cli_adapters;
mod cli_gguf;
mod cli_model;
mod cli_reliability;
mod cli_train;
mod code_cli;
mod device_sampling;
mod env_cli;
mod external_env;
mod flash_attention;
mod fused_ops;
mod generation;
mod gguf;
mod gguf_smollm2;
mod mixed_precision;
mod model_errors;
mod newcomer;
mod prefix_sharing;
mod quantized;
mod run_reliability;
mod smollm2_configs;
mod train_run;
mod width_padding;
