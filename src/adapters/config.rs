//! `adapter_config.json`: PEFT's LoRA configuration, read from any PEFT-written directory and
//! written with the fields PEFT expects.

use std::path::Path;

use serde_json::Value;

use crate::error::{Result, TroupeError};
use crate::model::Projection;

/// Largest LoRA scale (`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA) in magnitude: PEFT's usual
/// scales are 0.5 to 4; far beyond them the update overflows or drowns the base.
pub const MAX_SCALE: f64 = 1.0e4;

crate::section::config_section! {
    /// The LoRA hyper-parameters of one adapter (PEFT's `LoraConfig` fields troupe uses); a
    /// run's `adapter:` section, every agent's adapter.
    pub struct AdapterConfig {
        /// Rank `r` of the low-rank update.
        pub r: usize = 8,
        /// `lora_alpha`: the update is scaled by alpha / r (or alpha / sqrt(r) with rsLoRA).
        pub lora_alpha: f64 = 16.0,
        /// The projections that get an update (`q_proj`, `k_proj`, `v_proj`, `o_proj`,
        /// `gate_proj`, `up_proj`, `down_proj`).
        pub target_modules: Vec<Projection> = vec![Projection::Q, Projection::K, Projection::V, Projection::O],
        /// Dropout on the adapter's input, in training only, in [0, 1).
        pub lora_dropout: f64 = 0.0,
        /// rsLoRA scaling (alpha / sqrt(r)).
        pub use_rslora: bool = false,
        /// Recorded in `adapter_config.json` for deployment tools (a run records its
        /// `model.path`; not a key of the `adapter:` section).
        #[serde(skip)]
        pub base_model_name_or_path: Option<String> = None,
    }
}

impl AdapterConfig {
    /// The factor the low-rank product is multiplied by.
    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.lora_alpha / (self.r as f64).sqrt()
        } else {
            self.lora_alpha / self.r as f64
        }
    }

    /// Checks ranges (rank positive, dropout in [0, 1), at least one target).
    pub fn validate(&self, origin: &Path) -> Result<()> {
        let bad = |field: &str, message: String| TroupeError::BadValue {
            origin: Some(origin.to_path_buf()),
            key: field.to_string(),
            message,
        };
        if self.r == 0 {
            return Err(bad("r", "must be positive".into()));
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            return Err(bad("lora_dropout", format!("{} is not in [0, 1)", self.lora_dropout)));
        }
        if self.target_modules.is_empty() {
            return Err(bad("target_modules", "names no module".into()));
        }
        if !self.lora_alpha.is_finite() {
            return Err(bad("lora_alpha", "must be a finite number".into()));
        }
        if !self.scale().is_finite() || self.scale().abs() > MAX_SCALE {
            return Err(bad(
                "lora_alpha",
                format!(
                    "{} with r {} gives a scale of {:e}, beyond the largest allowed ({MAX_SCALE:e})",
                    self.lora_alpha,
                    self.r,
                    self.scale()
                ),
            ));
        }
        Ok(())
    }

    /// Parses a module name list from PEFT's `target_modules` (a list, or `"all-linear"`).
    pub fn parse_targets(value: &Value, origin: &Path) -> Result<Vec<Projection>> {
        let bad = |message: String| TroupeError::BadValue {
            origin: Some(origin.to_path_buf()),
            key: "target_modules".into(),
            message,
        };
        let names: Vec<String> = match value {
            Value::String(s) if s == "all-linear" => {
                return Ok(Projection::ALL.to_vec());
            }
            Value::String(s) => vec![s.clone()],
            Value::Array(items) => items
                .iter()
                .map(|v| v.as_str().map(str::to_string).ok_or_else(|| bad(format!("{v} is not a module name"))))
                .collect::<Result<_>>()?,
            other => return Err(bad(format!("{other} is not a list of module names"))),
        };
        let mut targets = Vec::new();
        for name in names {
            let projection = Projection::from_module_name(&name).ok_or_else(|| {
                bad(format!(
                    "unknown target module {name:?} (known: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"
                ))
            })?;
            if !targets.contains(&projection) {
                targets.push(projection);
            }
        }
        targets.sort();
        Ok(targets)
    }

    /// Reads a PEFT `adapter_config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| TroupeError::io(path, e))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| TroupeError::Json { path: path.to_path_buf(), message: e.to_string() })?;
        let field = |name: &str| json.get(name).filter(|v| !v.is_null());
        let bad = |name: &str, message: &str| TroupeError::BadValue {
            origin: Some(path.to_path_buf()),
            key: name.to_string(),
            message: message.to_string(),
        };
        if let Some(kind) = field("peft_type").and_then(Value::as_str) {
            if kind != "LORA" {
                return Err(bad("peft_type", &format!("{kind:?} is not supported (only LORA)")));
            }
        }
        for unsupported in ["use_dora", "fan_in_fan_out"] {
            if field(unsupported).and_then(Value::as_bool) == Some(true) {
                return Err(bad(unsupported, "true is not supported"));
            }
        }
        for pattern in ["rank_pattern", "alpha_pattern"] {
            if field(pattern).and_then(Value::as_object).is_some_and(|m| !m.is_empty()) {
                return Err(bad(pattern, "per-module ranks or alphas are not supported"));
            }
        }
        if let Some(bias) = field("bias").and_then(Value::as_str) {
            if bias != "none" {
                return Err(bad("bias", &format!("{bias:?} is not supported (only \"none\")")));
            }
        }
        let r =
            field("r").and_then(Value::as_u64).ok_or_else(|| bad("r", "missing or not a positive integer"))? as usize;
        // A field that is present must have its type: PEFT's defaults stand only for absent ones.
        let typed = |name: &str, kind: &str, read: fn(&Value) -> Option<Value>| -> Result<Option<Value>> {
            match json.get(name) {
                None => Ok(None),
                Some(value) => read(value).map(Some).ok_or_else(|| bad(name, &format!("{value} is not {kind}"))),
            }
        };
        let number = |v: &Value| v.as_f64().map(Value::from);
        let boolean = |v: &Value| v.as_bool().map(Value::from);
        let lora_alpha = typed("lora_alpha", "a number", number)?.and_then(|v| v.as_f64()).unwrap_or(8.0);
        let lora_dropout = typed("lora_dropout", "a number", number)?.and_then(|v| v.as_f64()).unwrap_or(0.0);
        let use_rslora = typed("use_rslora", "true or false", boolean)?.and_then(|v| v.as_bool()).unwrap_or(false);
        let config = Self {
            r,
            lora_alpha,
            target_modules: Self::parse_targets(
                field("target_modules").ok_or_else(|| bad("target_modules", "missing"))?,
                path,
            )?,
            lora_dropout,
            use_rslora,
            base_model_name_or_path: field("base_model_name_or_path").and_then(Value::as_str).map(str::to_string),
        };
        config.validate(path)?;
        Ok(config)
    }

    /// The `adapter_config.json` PEFT writes for this configuration.
    pub fn to_peft_json(&self) -> Value {
        let targets: Vec<&str> = self.target_modules.iter().map(|p| p.module_name()).collect();
        serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "target_modules": targets,
            "lora_dropout": self.lora_dropout,
            "use_rslora": self.use_rslora,
            "bias": "none",
            "base_model_name_or_path": self.base_model_name_or_path,
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "modules_to_save": null,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "use_dora": false,
            "lora_bias": false,
        })
    }
}
