//! API errors rendered as real `metav1.Status` objects (`kind: Status`, `code`, `reason`,
//! `message`, `details`), which is what `kube` decodes into `kube::Error::Api`.

use serde_json::{Value, json};

/// An error answered to a client, with the HTTP code and the Kubernetes `reason`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status code (also `Status.code`).
    pub code: u16,
    /// `Status.reason`, e.g. `Conflict`, `NotFound`, `Invalid`.
    pub reason: &'static str,
    /// Human-readable message, worded like the real API server's.
    pub message: String,
    /// `details.name` (object name) when known.
    pub name: String,
    /// `details.kind` (the plural resource, as the real server puts it) when known.
    pub kind: String,
}

impl ApiError {
    /// A new error with no details.
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
            name: String::new(),
            kind: String::new(),
        }
    }

    /// Attach `details.kind` and `details.name`.
    pub fn with_details(mut self, kind: &str, name: &str) -> Self {
        self.kind = kind.to_string();
        self.name = name.to_string();
        self
    }

    /// 404 NotFound for `plural "name"`.
    pub fn not_found(plural: &str, name: &str) -> Self {
        Self::new(404, "NotFound", format!("{plural} \"{name}\" not found")).with_details(plural, name)
    }

    /// 409 AlreadyExists.
    pub fn already_exists(plural: &str, name: &str) -> Self {
        Self::new(409, "AlreadyExists", format!("{plural} \"{name}\" already exists")).with_details(plural, name)
    }

    /// 409 Conflict with the real server's optimistic-concurrency wording.
    pub fn conflict(plural: &str, name: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {plural} \"{name}\": the object has been \
                 modified; please apply your changes to the latest version and try again"
            ),
        )
        .with_details(plural, name)
    }

    /// 422 Invalid.
    pub fn invalid(plural: &str, name: &str, why: impl std::fmt::Display) -> Self {
        Self::new(422, "Invalid", format!("{plural} \"{name}\" is invalid: {why}")).with_details(plural, name)
    }

    /// 400 BadRequest.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    /// 410 Expired (resource version too old for a watch).
    pub fn expired(requested: u64, oldest: u64) -> Self {
        Self::new(
            410,
            "Expired",
            format!("too old resource version: {requested} ({oldest})"),
        )
    }

    /// The `Status` object.
    pub fn to_status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if !self.name.is_empty() || !self.kind.is_empty() {
            s["details"] = json!({"name": self.name, "kind": self.kind});
        }
        s
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}
