//! LoRA adapters, one per agent over one frozen base: the layers and their PEFT initialisation,
//! `MultiAdapterManager`, mixed-adapter batches, per-adapter AdamW, PEFT-format files, merging.

pub mod config;
pub mod lora;
pub mod manager;
pub mod merge;
pub mod mixed;
pub mod optim;
pub mod peft;

pub use config::AdapterConfig;
pub use lora::{LoraAdapter, LoraPair, Site};
pub use manager::{MultiAdapterManager, SHARED_ADAPTER};
pub use mixed::{MixedLora, StackedFactors};
pub use optim::{AdamWConfig, AdamWState};
pub use peft::{AdapterMode, Manifest};
