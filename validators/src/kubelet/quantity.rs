//! Exact Kubernetes resource quantities.
//!
//! `k8s_openapi`'s `Quantity` is only the string the API server sent; the arithmetic the
//! allocatable and fit stages need (free = allocatable − requests, floor(free / request))
//! must be exact, so this parses the apimachinery grammar into an integer count of
//! milli-units:
//!
//! ```text
//! <quantity>        ::= <signedNumber><suffix>
//! <number>          ::= <digits> | <digits>.<digits> | <digits>. | .<digits>
//! <suffix>          ::= <binarySI> | <decimalExponent> | <decimalSI>
//! <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei
//! <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E
//! <decimalExponent> ::= e <signedNumber> | E <signedNumber>
//! ```
//!
//! Values finer than a milli-unit are rounded up, as Kubernetes' `MilliValue` does, so a
//! request is never under-counted.

use crate::reason::Reason;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// A resource quantity held exactly as a signed number of milli-units (1 CPU = 1000,
/// 1 byte of memory = 1000).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Quantity {
    milli: i128,
}

/// A string that is not a Kubernetes quantity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid quantity {text:?}: {why}")]
pub struct QuantityError {
    /// The rejected text.
    pub text: String,
    /// What is wrong with it.
    pub why: String,
}

impl QuantityError {
    fn new(text: &str, why: impl Into<String>) -> Self {
        Self {
            text: text.chars().take(64).collect(),
            why: why.into(),
        }
    }
}

impl crate::reason::ReasonCode for QuantityError {
    /// Stable reason code.
    fn reason(&self) -> Reason {
        Reason::InvalidInput
    }
}

/// Longest mantissa accepted; keeps every intermediate product inside `i128`.
const MAX_DIGITS: usize = 24;
/// Largest decimal exponent accepted (1e24 milli-units is far beyond any real node).
const MAX_EXPONENT: i32 = 24;

impl Quantity {
    /// Zero.
    pub const ZERO: Quantity = Quantity { milli: 0 };

    /// A quantity of `milli` milli-units.
    pub const fn from_milli(milli: i128) -> Self {
        Self { milli }
    }

    /// A quantity of `units` whole units.
    pub const fn from_units(units: i128) -> Self {
        Self { milli: units * 1000 }
    }

    /// Parse a quantity string (`"500m"`, `"2"`, `"736Gi"`, `"1.5e3"`, `"110"`).
    pub fn parse(text: &str) -> Result<Self, QuantityError> {
        parse(text)
    }

    /// The exact value in milli-units.
    pub const fn milli(&self) -> i128 {
        self.milli
    }

    /// The value in whole units, rounded up (Kubernetes' `Value()`).
    pub fn ceil_units(&self) -> i128 {
        self.milli.div_euclid(1000) + i128::from(self.milli.rem_euclid(1000) != 0)
    }

    /// The value as a count of devices or pods: whole and not negative, else `None`.
    pub fn as_count(&self) -> Option<u64> {
        if self.milli < 0 || self.milli % 1000 != 0 {
            return None;
        }
        u64::try_from(self.milli / 1000).ok()
    }

    /// True when zero.
    pub const fn is_zero(&self) -> bool {
        self.milli == 0
    }

    /// `self − other`, never below zero (free capacity cannot be negative).
    pub fn saturating_sub(self, other: Quantity) -> Quantity {
        Quantity {
            milli: self.milli.saturating_sub(other.milli).max(0),
        }
    }

    /// `self + other`, saturating (sums of hostile pod requests cannot overflow).
    pub fn saturating_add(self, other: Quantity) -> Quantity {
        Quantity {
            milli: self.milli.saturating_add(other.milli),
        }
    }

    /// floor(self / per): how many `per` fit in `self`; `None` when `per` is not positive.
    pub fn fits(&self, per: Quantity) -> Option<u64> {
        if per.milli <= 0 {
            return None;
        }
        let n = self.milli.max(0) / per.milli;
        Some(u64::try_from(n).unwrap_or(u64::MAX))
    }

    /// Render as a decimal number of `unit` milli-units per displayed unit, trimming
    /// trailing zeros (`736`, `87.5`, `0.25`). Used for the fit table.
    pub fn display_in(&self, unit_milli: i128) -> String {
        if unit_milli <= 0 {
            return self.to_string();
        }
        let whole = self.milli / unit_milli;
        let rem = (self.milli % unit_milli).abs();
        if rem == 0 {
            return whole.to_string();
        }
        // Three decimals are enough to tell values apart in a human table.
        let frac = (rem * 1000 + unit_milli / 2) / unit_milli;
        if frac >= 1000 {
            return (whole + self.milli.signum()).to_string();
        }
        let mut s = format!("{whole}.{frac:03}");
        while s.ends_with('0') {
            s.pop();
        }
        if self.milli < 0 && whole == 0 {
            s.insert(0, '-');
        }
        s
    }
}

fn pow10(e: u32) -> Option<i128> {
    10i128.checked_pow(e)
}

fn parse(text: &str) -> Result<Quantity, QuantityError> {
    let s = text.trim();
    if s.is_empty() {
        return Err(QuantityError::new(text, "empty"));
    }
    let bytes = s.as_bytes();
    let mut i = 0;
    let negative = match bytes[0] {
        b'-' => {
            i = 1;
            true
        }
        b'+' => {
            i = 1;
            false
        }
        _ => false,
    };
    let int_start = i;
    while i < bytes.len() && bytes[i].is_ascii_digit() {
        i += 1;
    }
    let int_digits = &s[int_start..i];
    let mut frac_digits = "";
    if i < bytes.len() && bytes[i] == b'.' {
        i += 1;
        let frac_start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        frac_digits = &s[frac_start..i];
    }
    if int_digits.is_empty() && frac_digits.is_empty() {
        return Err(QuantityError::new(text, "no digits"));
    }
    let digits: String = format!("{int_digits}{frac_digits}").trim_start_matches('0').to_string();
    if digits.len() > MAX_DIGITS {
        return Err(QuantityError::new(
            text,
            format!("more than {MAX_DIGITS} significant digits"),
        ));
    }
    let mantissa: i128 = if digits.is_empty() {
        0
    } else {
        digits.parse().map_err(|_| QuantityError::new(text, "bad digits"))?
    };
    let suffix = &s[i..];
    // value = mantissa × 10^(dec_exp − frac_len) × 2^bin_exp, in units.
    let (dec_exp, bin_exp): (i32, u32) = match suffix {
        "" => (0, 0),
        "n" => (-9, 0),
        "u" => (-6, 0),
        "m" => (-3, 0),
        "k" => (3, 0),
        "M" => (6, 0),
        "G" => (9, 0),
        "T" => (12, 0),
        "P" => (15, 0),
        "E" => (18, 0),
        "Ki" => (0, 10),
        "Mi" => (0, 20),
        "Gi" => (0, 30),
        "Ti" => (0, 40),
        "Pi" => (0, 50),
        "Ei" => (0, 60),
        other if other.starts_with(['e', 'E']) => {
            let exp = &other[1..];
            let body = exp.strip_prefix(['+', '-']).unwrap_or(exp);
            if body.is_empty() || !body.bytes().all(|b| b.is_ascii_digit()) || body.len() > 4 {
                return Err(QuantityError::new(text, format!("bad exponent {other:?}")));
            }
            let e: i32 = exp
                .parse()
                .map_err(|_| QuantityError::new(text, format!("bad exponent {other:?}")))?;
            if e.abs() > MAX_EXPONENT {
                return Err(QuantityError::new(text, format!("exponent {e} out of range")));
            }
            (e, 0)
        }
        other => {
            return Err(QuantityError::new(text, format!("unknown suffix {other:?}")));
        }
    };
    let frac_len = i32::try_from(frac_digits.len()).map_err(|_| QuantityError::new(text, "too long"))?;
    // Milli-units: one more factor of 10^3.
    let exp10 = dec_exp - frac_len + 3;
    let overflow = || QuantityError::new(text, "too large");
    let scaled = mantissa.checked_mul(1i128 << bin_exp).ok_or_else(overflow)?;
    let milli = if exp10 >= 0 {
        scaled
            .checked_mul(pow10(exp10.unsigned_abs()).ok_or_else(overflow)?)
            .ok_or_else(overflow)?
    } else {
        let div = pow10(exp10.unsigned_abs()).ok_or_else(overflow)?;
        // Round up to the next milli-unit, like MilliValue().
        scaled / div + i128::from(scaled % div != 0)
    };
    Ok(Quantity {
        milli: if negative { -milli } else { milli },
    })
}

impl FromStr for Quantity {
    type Err = QuantityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse(s)
    }
}

impl fmt::Display for Quantity {
    /// Canonical-ish form: whole units when exact, else milli-units (`500m`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.milli % 1000 == 0 {
            write!(f, "{}", self.milli / 1000)
        } else {
            write!(f, "{}m", self.milli)
        }
    }
}

/// In a config, a quantity is written as Kubernetes writes it: a string (`500m`, `300Gi`)
/// or a plain number (`40`).
impl schemars::JsonSchema for Quantity {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Quantity".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": ["string", "number"],
            "description": "A Kubernetes quantity such as 40, 500m or 300Gi."
        })
    }
}

impl Serialize for Quantity {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Quantity {
    /// Accepts a quantity string or a plain YAML/JSON number (`cpu: 40`).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Quantity;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a Kubernetes quantity such as 40, 500m or 300Gi")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Quantity, E> {
                parse(v).map_err(E::custom)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Quantity, E> {
                Ok(Quantity::from_units(i128::from(v)))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Quantity, E> {
                Ok(Quantity::from_units(i128::from(v)))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Quantity, E> {
                // `0.5` in YAML: go through the decimal text so 0.1 stays exactly 100m.
                parse(&v.to_string()).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// Parse a `k8s_openapi` quantity (the raw API string).
pub fn from_k8s(q: &k8s_openapi::apimachinery::pkg::api::resource::Quantity) -> Result<Quantity, QuantityError> {
    parse(&q.0)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn m(s: &str) -> i128 {
        Quantity::parse(s).unwrap().milli()
    }

    #[test]
    fn grammar_table() {
        let cases: &[(&str, i128)] = &[
            ("0", 0),
            ("1", 1000),
            ("+2", 2000),
            ("-3", -3000),
            ("500m", 500),
            ("1.5", 1500),
            ("1.", 1000),
            (".5", 500),
            ("0.0001", 1), // rounded up to one milli-unit
            ("100n", 1),
            ("1000000n", 1),
            ("1u", 1),
            ("2k", 2_000_000),
            ("1M", 1_000_000_000),
            ("1G", 1_000_000_000_000),
            ("1Ki", 1_024_000),
            ("1Mi", 1_048_576_000),
            ("300Gi", 300 * (1i128 << 30) * 1000),
            ("1.5Gi", 3 * (1i128 << 29) * 1000),
            ("1Ei", (1i128 << 60) * 1000),
            ("1E", 1_000_000_000_000_000_000_000),
            ("1e3", 1_000_000),
            ("1E3", 1_000_000),
            ("1.5e-3", 2), // 1.5m rounds up to 2m
            ("12e+1", 120_000),
            ("110", 110_000),
        ];
        for (text, want) in cases {
            assert_eq!(m(text), *want, "{text}");
        }
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "", " ", "abc", "1.2.3", "1Gb", "1KiB", "--1", "1e", "1e+", "1ee3", "1e99", ".", "1 Gi", "0x10", "1e3Gi",
        ] {
            let e = Quantity::parse(bad).unwrap_err();
            assert!(e.to_string().contains("invalid quantity"), "{bad}: {e}");
        }
        assert!(Quantity::parse("9999999999999999999999999999999").is_err());
        assert!(Quantity::parse("99999999999999999999Ei").is_err());
    }

    #[test]
    fn arithmetic_and_display() {
        let free = Quantity::parse("88").unwrap();
        assert_eq!(free.fits(Quantity::parse("40").unwrap()), Some(2));
        assert_eq!(free.fits(Quantity::ZERO), None);
        assert_eq!(
            Quantity::parse("1")
                .unwrap()
                .saturating_sub(Quantity::parse("2").unwrap()),
            Quantity::ZERO
        );
        assert_eq!(Quantity::parse("500m").unwrap().to_string(), "500m");
        assert_eq!(Quantity::parse("2").unwrap().to_string(), "2");
        assert_eq!(Quantity::parse("1500m").unwrap().ceil_units(), 2);
        assert_eq!(Quantity::parse("8").unwrap().as_count(), Some(8));
        assert_eq!(Quantity::parse("500m").unwrap().as_count(), None);
        let gib = (1i128 << 30) * 1000;
        assert_eq!(Quantity::parse("736Gi").unwrap().display_in(gib), "736");
        assert_eq!(Quantity::parse("735.5Gi").unwrap().display_in(gib), "735.5");
        assert_eq!(Quantity::parse("87500m").unwrap().display_in(1000), "87.5");
    }

    #[test]
    fn deserializes_numbers_and_strings() {
        #[derive(Deserialize)]
        struct T {
            a: Quantity,
            b: Quantity,
            c: Quantity,
        }
        let t: T = serde_yaml_ng::from_str("a: 40\nb: 300Gi\nc: 0.1\n").unwrap();
        assert_eq!(t.a.milli(), 40_000);
        assert_eq!(t.b, Quantity::parse("300Gi").unwrap());
        assert_eq!(t.c.milli(), 100);
        assert!(serde_yaml_ng::from_str::<T>("a: 4x\nb: 1\nc: 1\n").is_err());
    }
}
