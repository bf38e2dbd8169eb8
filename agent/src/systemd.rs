//! systemd integration for image-baked nodes (`Type=notify`): `READY=1` once the gate is
//! in place (after the reboot re-gate step; the unit orders kubelet after taintgate and
//! the kubelet must run for the kubelet-side stages to pass), a `STATUS=` line as each
//! stage ends and at the verdict (`released: ...` / `held: ...`), and `STOPPING=1` on
//! shutdown. Silent when `NOTIFY_SOCKET` is unset (DaemonSet, tests, terminals).
//!
//! Messages go through one background thread, in order: a datagram send blocks when the
//! receiver's queue is full, and the agent must never stall on its status line.

use sd_notify::NotifyState;
use std::sync::OnceLock;
use std::sync::mpsc::{Sender, channel};

enum Msg {
    Status(String),
    Ready(String),
    Stopping,
}

fn sender() -> Option<&'static Sender<Msg>> {
    static TX: OnceLock<Option<Sender<Msg>>> = OnceLock::new();
    TX.get_or_init(|| {
        std::env::var_os("NOTIFY_SOCKET")?;
        let (tx, rx) = channel::<Msg>();
        std::thread::Builder::new()
            .name("sd-notify".into())
            .spawn(move || {
                for m in rx {
                    let r = match &m {
                        Msg::Status(s) => sd_notify::notify(&[NotifyState::Status(s)]),
                        Msg::Ready(s) => sd_notify::notify(&[NotifyState::Ready, NotifyState::Status(s)]),
                        Msg::Stopping => sd_notify::notify(&[NotifyState::Stopping]),
                    };
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "sd_notify failed");
                    }
                }
            })
            .ok()?;
        Some(tx)
    })
    .as_ref()
}

fn send(m: Msg) {
    if let Some(tx) = sender() {
        let _ = tx.send(m);
    }
}

/// Send a status line (shown by `systemctl status taintgate`).
pub fn status(line: &str) {
    send(Msg::Status(line.to_string()));
}

/// Tell systemd the service is ready: the gate (startup taint) is in place.
pub fn ready(line: &str) {
    send(Msg::Ready(line.to_string()));
}

/// Tell systemd we are stopping.
pub fn stopping() {
    send(Msg::Stopping);
}
