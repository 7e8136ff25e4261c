//! `Display` and `FromStr` for the option enums a command line or a config file names:
//! [`DType`] (`f32`, `f16`, `bf16`), [`Variant`] (`auto`, `fa1`..`fa4`), [`Backend`] (`auto`,
//! `cpu`, `cuda`, `cuda:N`) and [`Mask`] (`none`, `causal`, `window:LEFT,RIGHT`,
//! `window:LEFT,RIGHT,causal`, `causal-window:LEFT`). Each `Display` parses back to the same
//! value; parsing is case-insensitive and a bad name is [`Error::InvalidOption`] listing the
//! accepted forms.

use crate::error::Error;
use crate::options::{Backend, Mask, Variant};
use crate::tensor::DType;
use std::fmt;
use std::str::FromStr;

fn invalid(option: &'static str, got: &str, expected: &str) -> Error {
    Error::InvalidOption { option, got: format!("{got:?}"), expected: expected.into() }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        })
    }
}

impl FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Ok(DType::F32),
            "f16" | "fp16" | "float16" | "half" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            _ => Err(invalid("dtype", s, "f32, f16 or bf16 (or fp32/float32, fp16/float16/half, bfloat16)")),
        }
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Variant::Auto => "auto",
            Variant::Fa1 => "fa1",
            Variant::Fa2 => "fa2",
            Variant::Fa3 => "fa3",
            Variant::Fa4 => "fa4",
        })
    }
}

impl FromStr for Variant {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Variant::Auto),
            "fa1" => Ok(Variant::Fa1),
            "fa2" => Ok(Variant::Fa2),
            "fa3" => Ok(Variant::Fa3),
            "fa4" => Ok(Variant::Fa4),
            _ => Err(invalid("variant", s, "auto, fa1, fa2, fa3 or fa4")),
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backend::Auto => f.write_str("auto"),
            Backend::Cpu => f.write_str("cpu"),
            Backend::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for Backend {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        const EXPECTED: &str = "auto, cpu, cuda (device 0) or cuda:N";
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "auto" => Ok(Backend::Auto),
            "cpu" => Ok(Backend::Cpu),
            "cuda" => Ok(Backend::Cuda(0)),
            _ => match t.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Backend::Cuda(n)),
                _ => Err(invalid("backend", s, EXPECTED)),
            },
        }
    }
}

impl fmt::Display for Mask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mask::None => f.write_str("none"),
            Mask::Causal => f.write_str("causal"),
            Mask::Window { left, right, causal: false } => write!(f, "window:{left},{right}"),
            Mask::Window { left, right, causal: true } => write!(f, "window:{left},{right},causal"),
        }
    }
}

impl FromStr for Mask {
    type Err = Error;
    /// The bounds are not range-checked here (a window of -5 parses); `forward` validates them.
    fn from_str(s: &str) -> Result<Self, Error> {
        const EXPECTED: &str = "none, causal, window:LEFT,RIGHT, window:LEFT,RIGHT,causal or causal-window:LEFT \
                                (bounds are integers, -1 for unbounded)";
        let t = s.trim().to_ascii_lowercase();
        let bad = || invalid("mask", s, EXPECTED);
        let int = |x: &str| x.trim().parse::<i64>().map_err(|_| bad());
        match t.as_str() {
            "none" | "full" => return Ok(Mask::None),
            "causal" => return Ok(Mask::Causal),
            _ => {}
        }
        if let Some(left) = t.strip_prefix("causal-window:") {
            return Ok(Mask::causal_window(int(left)?));
        }
        let Some(rest) = t.strip_prefix("window:") else { return Err(bad()) };
        let parts: Vec<&str> = rest.split(',').collect();
        match parts.as_slice() {
            [l, r] => Ok(Mask::window(int(l)?, int(r)?)),
            [l, r, c] if c.trim() == "causal" => Ok(Mask::Window { left: int(l)?, right: int(r)?, causal: true }),
            _ => Err(bad()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_display_parses_back() {
        for d in [DType::F32, DType::F16, DType::BF16] {
            assert_eq!(d.to_string().parse::<DType>().unwrap(), d);
        }
        for v in [Variant::Auto, Variant::Fa1, Variant::Fa2, Variant::Fa3, Variant::Fa4] {
            assert_eq!(v.to_string().parse::<Variant>().unwrap(), v);
        }
        for b in [Backend::Auto, Backend::Cpu, Backend::Cuda(0), Backend::Cuda(3)] {
            assert_eq!(b.to_string().parse::<Backend>().unwrap(), b);
        }
        let masks = [Mask::None, Mask::Causal, Mask::window(128, -1), Mask::window(-1, 4), Mask::causal_window(256)];
        for m in masks.into_iter().chain([Mask::Window { left: 8, right: -1, causal: true }]) {
            assert_eq!(m.to_string().parse::<Mask>().unwrap(), m, "{m}");
        }
    }

    #[test]
    fn aliases_and_case() {
        assert_eq!("BF16".parse::<DType>().unwrap(), DType::BF16);
        assert_eq!("bfloat16".parse::<DType>().unwrap(), DType::BF16);
        assert_eq!("fp16".parse::<DType>().unwrap(), DType::F16);
        assert_eq!("cuda".parse::<Backend>().unwrap(), Backend::Cuda(0));
        assert_eq!(" FA2 ".parse::<Variant>().unwrap(), Variant::Fa2);
        assert_eq!("causal-window:64".parse::<Mask>().unwrap(), Mask::causal_window(64));
    }

    #[test]
    fn bad_names_are_typed_errors_listing_the_forms() {
        for (e, what) in [
            ("f64".parse::<DType>().unwrap_err(), "dtype"),
            ("fa9".parse::<Variant>().unwrap_err(), "variant"),
            ("cuda:x".parse::<Backend>().unwrap_err(), "backend"),
            ("window:3".parse::<Mask>().unwrap_err(), "mask"),
            ("window:1,2,sideways".parse::<Mask>().unwrap_err(), "mask"),
        ] {
            match &e {
                Error::InvalidOption { option, expected, .. } => {
                    assert_eq!(*option, what);
                    assert!(!expected.is_empty());
                }
                other => panic!("{other:?}"),
            }
        }
    }
}
