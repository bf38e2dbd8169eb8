//! Fault injection state of the fault proxy, settable at runtime from a test:
//! request-matched error bursts, forced 409s, added latency, concurrent-writer hooks, and
//! watch drops.

use std::time::Duration;

use serde_json::Value;

/// Which requests a fault applies to. Empty fields match everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestMatch {
    /// HTTP method, e.g. `PATCH` (case-insensitive).
    pub method: Option<String>,
    /// Substring of the URL path, e.g. `/nodes/gpu-0`.
    pub path_contains: Option<String>,
    /// `Some(true)`: only watch requests; `Some(false)`: only non-watch requests.
    pub watch: Option<bool>,
    /// Substring of the `User-Agent` header (tells one client from another, e.g.
    /// Karpenter's requests from the agent's when both go through the proxy).
    pub user_agent_contains: Option<String>,
}

impl RequestMatch {
    /// Match every request.
    pub fn any() -> Self {
        Self::default()
    }

    /// Only requests with this method.
    pub fn method(mut self, m: &str) -> Self {
        self.method = Some(m.to_ascii_uppercase());
        self
    }

    /// Only requests whose path contains `p`.
    pub fn path(mut self, p: &str) -> Self {
        self.path_contains = Some(p.to_string());
        self
    }

    /// Only watch (`true`) or only non-watch (`false`) requests.
    pub fn watch(mut self, w: bool) -> Self {
        self.watch = Some(w);
        self
    }

    /// Only requests whose `User-Agent` contains `ua`.
    pub fn user_agent(mut self, ua: &str) -> Self {
        self.user_agent_contains = Some(ua.to_string());
        self
    }

    /// True when the request is selected.
    pub fn matches(&self, method: &str, path: &str, watch: bool, user_agent: &str) -> bool {
        self.method.as_deref().is_none_or(|m| m.eq_ignore_ascii_case(method))
            && self.path_contains.as_deref().is_none_or(|p| path.contains(p))
            && self.watch.is_none_or(|w| w == watch)
            && self
                .user_agent_contains
                .as_deref()
                .is_none_or(|u| user_agent.contains(u))
    }
}

/// When a concurrent-writer hook runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HookTrigger {
    /// Right after the N-th (1-based, counted from registration) single-object GET of the
    /// object has been answered: the reader got the old state, the store then changes.
    AfterGet(usize),
    /// Just before the next PUT or PATCH of the object (main resource or `/status`) is
    /// applied: the write then meets the changed object.
    BeforeWrite,
}

/// A change made by "another controller".
pub type HookFn = Box<dyn FnOnce(&mut Value) + Send + 'static>;

pub(crate) struct Hook {
    pub rid: String,
    pub namespace: String,
    pub name: String,
    /// Only writes to this subresource (e.g. `status`); `None`: any write of the object.
    pub subresource: Option<String>,
    pub trigger: HookTrigger,
    pub gets_seen: usize,
    pub action: Option<HookFn>,
}

pub(crate) struct FailRule {
    pub remaining: usize,
    pub code: u16,
    pub m: RequestMatch,
}

pub(crate) struct ConflictRule {
    pub remaining: usize,
    pub m: RequestMatch,
}

/// All active faults.
#[derive(Default)]
pub(crate) struct Faults {
    pub fail: Vec<FailRule>,
    pub conflicts: Vec<ConflictRule>,
    pub latency: Duration,
    pub hooks: Vec<Hook>,
}

impl Faults {
    /// Consume one 5xx from the first matching rule; returns the code to answer.
    pub fn take_failure(&mut self, method: &str, path: &str, watch: bool, ua: &str) -> Option<u16> {
        let r = self
            .fail
            .iter_mut()
            .find(|r| r.remaining > 0 && r.m.matches(method, path, watch, ua))?;
        r.remaining -= 1;
        let code = r.code;
        self.fail.retain(|r| r.remaining > 0);
        Some(code)
    }

    /// Consume one forced conflict for a write.
    pub fn take_conflict(&mut self, method: &str, path: &str, ua: &str) -> bool {
        let Some(r) = self
            .conflicts
            .iter_mut()
            .find(|r| r.remaining > 0 && r.m.matches(method, path, false, ua))
        else {
            return false;
        };
        r.remaining -= 1;
        self.conflicts.retain(|r| r.remaining > 0);
        true
    }

    /// Take the before-write hooks for an object.
    pub fn take_before_write(&mut self, rid: &str, ns: &str, name: &str, sub: Option<&str>) -> Vec<HookFn> {
        let mut out = Vec::new();
        for h in &mut self.hooks {
            if h.trigger == HookTrigger::BeforeWrite
                && h.rid == rid
                && h.namespace == ns
                && h.name == name
                && h.subresource.as_deref().is_none_or(|s| Some(s) == sub)
                && let Some(a) = h.action.take()
            {
                out.push(a);
            }
        }
        self.hooks.retain(|h| h.action.is_some());
        out
    }

    /// Count a GET of an object and take the hooks whose count is reached.
    pub fn take_after_get(&mut self, rid: &str, ns: &str, name: &str) -> Vec<HookFn> {
        let mut out = Vec::new();
        for h in &mut self.hooks {
            if let HookTrigger::AfterGet(n) = h.trigger
                && h.rid == rid
                && h.namespace == ns
                && h.name == name
            {
                h.gets_seen += 1;
                if h.gets_seen >= n
                    && let Some(a) = h.action.take()
                {
                    out.push(a);
                }
            }
        }
        self.hooks.retain(|h| h.action.is_some());
        out
    }
}
