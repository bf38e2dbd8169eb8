//! systemd integration for image-baked nodes (`Type=notify`): `READY=1` once the gate is
//! in place (after the reboot re-gate step; the unit orders kubelet after taintgate and
//! the kubelet must run for the kubelet-side stages to pass), a `STATUS=` line as each
//! stage ends and at the verdict (`released: ...` / `held: ...`), and `STOPPING=1` on
//! shutdown. Silent when `NOTIFY_SOCKET` is unset (DaemonSet, tests, terminals).

use sd_notify::NotifyState;

/// Send a status line (shown by `systemctl status taintgate`).
pub fn status(line: &str) {
    if let Err(e) = sd_notify::notify(&[NotifyState::Status(line)]) {
        tracing::debug!(error = %e, "sd_notify STATUS failed");
    }
}

/// Tell systemd the service is ready: the gate (startup taint) is in place.
pub fn ready(line: &str) {
    if let Err(e) = sd_notify::notify(&[NotifyState::Ready, NotifyState::Status(line)]) {
        tracing::debug!(error = %e, "sd_notify READY failed");
    }
}

/// Tell systemd we are stopping.
pub fn stopping() {
    if let Err(e) = sd_notify::notify(&[NotifyState::Stopping]) {
        tracing::debug!(error = %e, "sd_notify STOPPING failed");
    }
}
