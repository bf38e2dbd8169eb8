//! One shape for every failure that carries a stable reason code. Every error type of the
//! boundaries and decisions implements [`ReasonCode`]; the agent turns any of them into a
//! stage failure with one blanket conversion, so a code is never copied by hand and a new
//! error type cannot reach a stage without one.

/// A failure with a stable reason code (CamelCase; catalogued in the agent's `reasons`).
pub trait ReasonCode: std::fmt::Display {
    /// The stable reason code.
    fn reason(&self) -> &'static str;
    /// Whether waiting or retrying may clear it (default: no).
    fn is_transient(&self) -> bool {
        false
    }
}
