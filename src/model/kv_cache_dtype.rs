//! `runtime.kv_cache`: the element type a generation's KV cache holds its keys and values in.

use burn::tensor::{DType, Device};
use serde::{Deserialize, Serialize};

/// `runtime.kv_cache`: what a generation's reserved KV cache holds its keys and values in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum KvCacheDtype {
    /// The base's precision (`model.dtype`) on a GPU when it is bf16 or f16, half the bytes of
    /// f32 (as transformers holds its cache in the model's dtype); f32 on the CPU, whose fused
    /// attention reads f32 (its runs compute what they did before the choice existed).
    #[default]
    Auto,
    /// f32 everywhere.
    F32,
}

impl KvCacheDtype {
    /// The name as the config writes it.
    pub fn name(self) -> &'static str {
        match self {
            KvCacheDtype::Auto => "auto",
            KvCacheDtype::F32 => "f32",
        }
    }

    /// The element type a cache holds for a base in `base` on `device`, when not f32.
    pub fn held(self, base: DType, device: &Device) -> Option<DType> {
        match self {
            KvCacheDtype::Auto if *device != Device::flex() && matches!(base, DType::BF16 | DType::F16) => Some(base),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_holds_a_half_precision_base_in_its_precision_off_the_cpu_only() {
        let cpu = Device::flex();
        for base in [DType::BF16, DType::F16, DType::F32] {
            assert_eq!(KvCacheDtype::Auto.held(base, &cpu), None, "{base:?} on the CPU");
            assert_eq!(KvCacheDtype::F32.held(base, &cpu), None);
        }
        assert_eq!(serde_yaml::from_str::<KvCacheDtype>("f32").unwrap(), KvCacheDtype::F32);
        assert_eq!(KvCacheDtype::Auto.name(), "auto");
    }
}
