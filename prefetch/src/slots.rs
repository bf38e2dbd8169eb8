//! Chunk slots handed out by rank: the global bound on requests in flight plus chunks
//! waiting to be hashed, served to the lowest rank first (files are ranked largest first),
//! and in arrival order within a rank.
//!
//! Why not tokio's FIFO `Semaphore`: with FIFO, a slot freed by the largest file's hasher
//! went to whichever small file had queued first, so the largest file ran on a fraction of
//! its window while the small files went by, and then had most of its bytes left when
//! they were done. Its hash is one serial stream, the longest single piece of work, so that
//! left one core busy and the other idle at the end of the run. Serving it first keeps its
//! hasher fed from the start (longest-processing-time-first scheduling); smaller files use
//! the slots it does not need, and each file's own window (see `fetch.rs`) leaves them some.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

/// A pool of slots, granted to the waiter with the lowest `(rank, arrival)` first.
pub(crate) struct Slots {
    inner: Arc<Mutex<Inner>>,
}

struct Inner {
    free: usize,
    next_seq: u64,
    /// Invariant: waiters are queued only while no slot is free.
    waiters: BTreeMap<(u64, u64), oneshot::Sender<()>>,
}

/// One held slot; given back (to the best waiter, or to the pool) when dropped.
pub(crate) struct Slot {
    inner: Arc<Mutex<Inner>>,
}

fn lock(inner: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    // Nothing panics while holding the lock, and its state is valid after any step anyway.
    inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Give one slot back: to the best waiter if any, else to the pool.
fn release(inner: &Mutex<Inner>) {
    let mut g = lock(inner);
    // Sent under the lock, so a cancelled waiter (see `Waiting::drop`) always finds out
    // whether it was granted a slot before it goes away.
    match g.waiters.pop_first() {
        Some((_, tx)) => {
            // The receiver lives as long as its waiter's entry, which we just held, so the
            // send cannot fail; if it ever did, the slot would return to the pool.
            if tx.send(()).is_err() {
                g.free += 1;
            }
        }
        None => g.free += 1,
    }
}

/// A queued waiter; removes itself (or gives back a slot granted too late) when dropped.
struct Waiting {
    inner: Arc<Mutex<Inner>>,
    key: (u64, u64),
    rx: oneshot::Receiver<()>,
    granted: bool,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if self.granted {
            return;
        }
        let was_queued = lock(&self.inner).waiters.remove(&self.key).is_some();
        if !was_queued {
            // Granted after this waiter was cancelled: pass the slot on.
            release(&self.inner);
        }
    }
}

impl Slots {
    /// A pool of `n` slots.
    pub(crate) fn new(n: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                free: n,
                next_seq: 0,
                waiters: BTreeMap::new(),
            })),
        }
    }

    /// Wait for a slot. Lower `rank` is served first; equal ranks in arrival order.
    /// Cancel-safe: dropping the future before it resolves never loses a slot.
    pub(crate) async fn acquire(&self, rank: u64) -> Slot {
        let mut waiting = {
            let mut g = lock(&self.inner);
            if g.free > 0 {
                g.free -= 1;
                return Slot {
                    inner: self.inner.clone(),
                };
            }
            let key = (rank, g.next_seq);
            g.next_seq += 1;
            let (tx, rx) = oneshot::channel();
            g.waiters.insert(key, tx);
            Waiting {
                inner: self.inner.clone(),
                key,
                rx,
                granted: false,
            }
        };
        // The sender is only dropped after sending (see `release`), so this resolves Ok.
        let _ = (&mut waiting.rx).await;
        waiting.granted = true;
        Slot {
            inner: self.inner.clone(),
        }
    }

    /// Slots not held by anyone.
    #[cfg(test)]
    fn free(&self) -> usize {
        lock(&self.inner).free
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        release(&self.inner);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn lowest_rank_first_then_arrival_order() {
        let slots = Arc::new(Slots::new(1));
        let held = slots.acquire(5).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, rank) in [("c3", 3), ("a0", 0), ("d3", 3), ("b1", 1)] {
            let (slots, order) = (slots.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let s = slots.acquire(rank).await;
                order.lock().unwrap().push(name);
                drop(s);
            }));
            // Queue them in this order.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        drop(held);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["a0", "b1", "c3", "d3"]);
        assert_eq!(slots.free(), 1);
    }

    #[tokio::test]
    async fn cancelled_waiter_loses_no_slot() {
        let slots = Arc::new(Slots::new(2));
        let a = slots.acquire(0).await;
        let b = slots.acquire(0).await;
        // A waiter cancelled while queued.
        let queued = tokio::time::timeout(Duration::from_millis(10), slots.acquire(0)).await;
        assert!(queued.is_err());
        // A waiter granted a slot but dropped before it ran: the slot passes on.
        let mut late = Box::pin(slots.acquire(1));
        assert!(futures::poll!(&mut late).is_pending());
        drop(a);
        drop(late);
        assert_eq!(slots.free(), 1);
        drop(b);
        assert_eq!(slots.free(), 2);
        let _x = slots.acquire(9).await;
        let _y = slots.acquire(9).await;
        assert_eq!(slots.free(), 0);
    }
}
