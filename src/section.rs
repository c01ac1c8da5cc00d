//! [`config_section!`]: a config struct whose every field carries its default beside it, as
//! burn's `#[derive(Config)]` writes `#[config(default = ...)]`. The struct reads strictly from
//! YAML/JSON (unknown keys refused, missing keys at their default) and its `Default` is built
//! from the same expressions, so a default is written once.

/// Declares a config struct: `field: Type = default_expression` per field. Derives `Clone`,
/// `Debug`, `PartialEq`, `Serialize` and `Deserialize` with `#[serde(deny_unknown_fields,
/// default)]`, and implements `Default` from the expressions. Field attributes (doc comments,
/// `#[serde(...)]`) pass through.
macro_rules! config_section {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $(
                $(#[$field_meta:meta])*
                $field_vis:vis $field:ident : $ty:ty = $default:expr
            ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
        #[serde(deny_unknown_fields, default)]
        $vis struct $name {
            $(
                $(#[$field_meta])*
                $field_vis $field: $ty,
            )*
        }

        impl Default for $name {
            fn default() -> Self {
                Self { $($field: $default,)* }
            }
        }
    };
}

pub(crate) use config_section;
