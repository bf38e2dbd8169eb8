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

/// A decision that holds the node: its stable code, a message naming what was read, and
/// whether waiting may clear it. The one failure type of the pure decisions that need
/// nothing more (the fabric's, the network's).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Hold {
    /// Stable reason code.
    pub reason: &'static str,
    /// Names the devices, GPUs and values read.
    pub message: String,
    /// Waiting may clear it (a link still training, a registration still running).
    pub transient: bool,
}

impl Hold {
    /// A hold that waiting does not clear.
    pub fn permanent(reason: &'static str, message: String) -> Self {
        Self {
            reason,
            message,
            transient: false,
        }
    }

    /// A hold that waiting may clear.
    pub fn transient(reason: &'static str, message: String) -> Self {
        Self {
            reason,
            message,
            transient: true,
        }
    }
}

impl ReasonCode for Hold {
    fn reason(&self) -> &'static str {
        self.reason
    }
    fn is_transient(&self) -> bool {
        self.transient
    }
}
