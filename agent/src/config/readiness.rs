//! The `readiness:` config section: whether the resident agent follows the first workload
//! on its node to its first ready endpoint, how long it waits, and which Pods count.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// `readiness:` — the chain after the untaint (see `docs/readiness-chain.md`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ReadinessConfig {
    /// Watch the node's Pods after release and record the workload's stamps.
    pub enabled: bool,
    /// Longest wait, from release, for the workload to become Ready. At the deadline the
    /// agent records `NoWorkloadYet` (not a failure of the node) and stops watching.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub deadline: Duration,
    /// Longest wait, once the workload is Ready, for an EndpointSlice to list it ready.
    /// A workload behind no Service never gets one; the chain then ends at `pod-ready`.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub endpoint_wait: Duration,
    /// Label selector (the API's syntax, e.g. `app=llm,tier in (serve)`) choosing the
    /// workload Pods. Empty: any Pod not owned by a DaemonSet (nor a static Pod).
    pub selector: String,
    /// Label naming a serving group spread over several Pods (e.g.
    /// `leaderworkerset.sigs.k8s.io/group-key`). Empty: the first Ready Pod ends the chain.
    pub group_label: String,
    /// Pods of one group (same `group_label` value) on this node that must all be Ready.
    /// Required (at least 1) when `group_label` is set.
    pub group_size: u32,
}

impl Default for ReadinessConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            deadline: Duration::from_secs(30 * 60),
            endpoint_wait: Duration::from_secs(2 * 60),
            selector: String::new(),
            group_label: String::new(),
            group_size: 0,
        }
    }
}

impl ReadinessConfig {
    /// Check the section; `Err((key, message))` names the offending key.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.deadline.is_zero() {
            return Err(("readiness.deadline", "must be greater than zero".into()));
        }
        if self.endpoint_wait > self.deadline {
            return Err((
                "readiness.endpoint_wait",
                format!(
                    "{:?} is longer than readiness.deadline ({:?})",
                    self.endpoint_wait, self.deadline
                ),
            ));
        }
        if self.selector.len() > 1024 || self.selector.chars().any(char::is_control) {
            return Err((
                "readiness.selector",
                "must be a one-line label selector of at most 1024 characters".into(),
            ));
        }
        if !self.group_label.is_empty() && !super::names::valid_qualified_name(&self.group_label) {
            return Err((
                "readiness.group_label",
                format!("{:?} is not a valid label key", self.group_label),
            ));
        }
        match (self.group_label.is_empty(), self.group_size) {
            (false, 0) => Err((
                "readiness.group_size",
                "must be at least 1 when readiness.group_label is set".into(),
            )),
            (true, n) if n > 0 => Err((
                "readiness.group_size",
                "has no effect without readiness.group_label; set both or neither".into(),
            )),
            _ => Ok(()),
        }
    }

    /// The server-side label selector, if one is configured.
    pub fn label_selector(&self) -> Option<&str> {
        let s = self.selector.trim();
        (!s.is_empty()).then_some(s)
    }

    /// The group rule, if one is configured.
    pub fn group(&self) -> Option<(&str, usize)> {
        (!self.group_label.is_empty()).then_some((self.group_label.as_str(), self.group_size as usize))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn validation_names_the_key() {
        assert!(ReadinessConfig::default().validate().is_ok());
        type Case = (fn(&mut ReadinessConfig), &'static str);
        let cases: [Case; 5] = [
            (|c| c.deadline = Duration::ZERO, "readiness.deadline"),
            (
                |c| c.endpoint_wait = Duration::from_secs(3600),
                "readiness.endpoint_wait",
            ),
            (|c| c.group_label = "a/b".into(), "readiness.group_size"),
            (|c| c.group_size = 4, "readiness.group_size"),
            (|c| c.group_label = "bad label".into(), "readiness.group_label"),
        ];
        for (f, key) in cases {
            let mut c = ReadinessConfig::default();
            f(&mut c);
            assert_eq!(c.validate().unwrap_err().0, key);
        }
        let mut c = ReadinessConfig {
            group_label: "example.com/group".into(),
            group_size: 4,
            ..Default::default()
        };
        assert_eq!(c.group(), Some(("example.com/group", 4)));
        c.selector = "  ".into();
        assert_eq!(c.label_selector(), None);
    }
}
