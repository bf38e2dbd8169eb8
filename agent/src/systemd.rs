//! systemd integration for image-baked nodes (`Type=notify`): `READY=1` once the gate is
//! in place (after the reboot re-gate step; the unit orders kubelet after taintgate and
//! the kubelet must run for the kubelet-side stages to pass), a `STATUS=` line as each
//! stage ends and at the verdict (`released: ...` / `held: ...`), and `STOPPING=1` on
//! shutdown. Silent when `NOTIFY_SOCKET` is unset (DaemonSet, tests, terminals).
//!
//! Messages go through one background thread, in order: a datagram send blocks when the
//! receiver's queue is full, and the agent must never stall on its status line. Before the
//! process exits, [`flush`] waits (bounded) until that thread has handed over everything
//! queued, so `--once` does not drop its verdict line.

use sd_notify::NotifyState;
use std::sync::OnceLock;
use std::sync::mpsc::{Sender, SyncSender, channel, sync_channel};
use std::time::Duration;

/// How long the agent waits at exit for pending notifications.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(2);

/// One notification, or a flush marker.
enum Msg {
    Status(String),
    Ready(String),
    Stopping,
    /// Answered once every message queued before it was handed to the sink.
    Flush(SyncSender<()>),
}

/// A notification as the sink receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notification {
    /// `STATUS=`.
    Status(String),
    /// `READY=1` plus `STATUS=`.
    Ready(String),
    /// `STOPPING=1`.
    Stopping,
}

/// An ordered queue in front of a sink that may block, served by one background thread.
pub struct Notifier {
    tx: Sender<Msg>,
}

impl Notifier {
    /// Start the background thread delivering to `sink`.
    pub fn spawn(mut sink: impl FnMut(Notification) + Send + 'static) -> std::io::Result<Self> {
        let (tx, rx) = channel::<Msg>();
        std::thread::Builder::new().name("sd-notify".into()).spawn(move || {
            for m in rx {
                match m {
                    Msg::Status(s) => sink(Notification::Status(s)),
                    Msg::Ready(s) => sink(Notification::Ready(s)),
                    Msg::Stopping => sink(Notification::Stopping),
                    Msg::Flush(ack) => {
                        // The waiter may have given up already; nothing to do then.
                        let _ = ack.try_send(());
                    }
                }
            }
        })?;
        Ok(Self { tx })
    }

    fn send(&self, m: Msg) {
        let _ = self.tx.send(m);
    }

    /// Queue a notification.
    pub fn notify(&self, n: Notification) {
        self.send(match n {
            Notification::Status(s) => Msg::Status(s),
            Notification::Ready(s) => Msg::Ready(s),
            Notification::Stopping => Msg::Stopping,
        });
    }

    /// Wait until everything queued so far was handed to the sink, at most `timeout`.
    /// Returns whether it was.
    pub fn flush(&self, timeout: Duration) -> bool {
        let (ack_tx, ack_rx) = sync_channel(1);
        if self.tx.send(Msg::Flush(ack_tx)).is_err() {
            // The thread is gone: nothing can be pending any more.
            return true;
        }
        ack_rx.recv_timeout(timeout).is_ok()
    }
}

fn deliver(n: Notification) {
    let r = match &n {
        Notification::Status(s) => sd_notify::notify(&[NotifyState::Status(s)]),
        Notification::Ready(s) => sd_notify::notify(&[NotifyState::Ready, NotifyState::Status(s)]),
        Notification::Stopping => sd_notify::notify(&[NotifyState::Stopping]),
    };
    if let Err(e) = r {
        tracing::debug!(error = %e, "sd_notify failed");
    }
}

fn notifier() -> Option<&'static Notifier> {
    static N: OnceLock<Option<Notifier>> = OnceLock::new();
    N.get_or_init(|| {
        std::env::var_os("NOTIFY_SOCKET")?;
        Notifier::spawn(deliver).ok()
    })
    .as_ref()
}

fn send(n: Notification) {
    if let Some(x) = notifier() {
        x.notify(n);
    }
}

/// Send a status line (shown by `systemctl status taintgate`).
pub fn status(line: &str) {
    send(Notification::Status(line.to_string()));
}

/// Tell systemd the service is ready: the gate (startup taint) is in place.
pub fn ready(line: &str) {
    send(Notification::Ready(line.to_string()));
}

/// Tell systemd we are stopping.
pub fn stopping() {
    send(Notification::Stopping);
}

/// Wait (at most `timeout`) until every notification sent so far has been handed to
/// systemd. True when nothing is pending (also when notifications are off).
pub fn flush(timeout: Duration) -> bool {
    notifier().is_none_or(|n| n.flush(timeout))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::sync::mpsc::Receiver;
    use std::sync::{Arc, Mutex};

    /// A sink that blocks on each message until the test lets it through, like a datagram
    /// socket whose receiver queue is full.
    fn gated() -> (Notifier, SyncSender<()>, Arc<Mutex<Vec<Notification>>>) {
        let (gate_tx, gate_rx): (SyncSender<()>, Receiver<()>) = sync_channel(64);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let seen2 = seen.clone();
        let n = Notifier::spawn(move |m| {
            gate_rx.recv().unwrap();
            seen2.lock().unwrap().push(m);
        })
        .unwrap();
        (n, gate_tx, seen)
    }

    #[test]
    fn flush_waits_for_pending_messages_and_is_bounded() {
        let (n, gate, seen) = gated();
        n.notify(Notification::Status("held: X".into()));
        n.notify(Notification::Status("released: all evidence".into()));
        n.notify(Notification::Stopping);
        // The sink is stuck: flush gives up at its bound instead of hanging the exit.
        let t0 = std::time::Instant::now();
        assert!(!n.flush(Duration::from_millis(50)));
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert!(seen.lock().unwrap().is_empty());
        // Once the sink drains, flush returns only after every earlier message went out.
        for _ in 0..3 {
            gate.send(()).unwrap();
        }
        assert!(n.flush(Duration::from_secs(30)));
        assert_eq!(
            *seen.lock().unwrap(),
            vec![
                Notification::Status("held: X".into()),
                Notification::Status("released: all evidence".into()),
                Notification::Stopping,
            ]
        );
    }

    #[test]
    fn flush_without_notifications_returns_at_once() {
        // NOTIFY_SOCKET is unset under `cargo test` unless the runner is a notify unit.
        if std::env::var_os("NOTIFY_SOCKET").is_none() {
            assert!(flush(Duration::from_millis(1)));
        }
    }
}
