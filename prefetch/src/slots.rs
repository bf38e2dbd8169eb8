//! Chunk slots handed out by rank: the global bound on requests in flight plus chunks
//! waiting to be hashed, served to the lowest rank first (files are ranked largest first),
//! and in arrival order within a rank, with at most `window` slots held by any one rank.
//!
//! Why not tokio's FIFO `Semaphore`: with FIFO, a slot freed by the largest file's hasher
//! went to whichever small file had queued first, so the largest file ran on a fraction of
//! its window while the small files went by, and then had most of its bytes left when
//! they were done. Its hash is one serial stream, the longest single piece of work, so that
//! left one core busy and the other idle at the end of the run. Serving it first keeps its
//! hasher fed from the start (longest-processing-time-first scheduling); smaller files use
//! the slots it does not need.
//!
//! Why the window is kept here rather than in a second, per-file semaphore: a file at its
//! window gives a slot back and wants it again at the same moment (its hasher consumed a
//! chunk, its next chunk is waiting). With two semaphores the global slot went to a
//! smaller file before the larger file's next chunk had passed its own semaphore. Here a
//! waiter over its window simply stays queued, and the release that brings it under is the
//! one that hands it the slot.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

/// A pool of slots, granted to the waiter with the lowest `(rank, arrival)` among those
/// holding fewer than `window`.
pub(crate) struct Slots {
    inner: Arc<Mutex<Inner>>,
}

struct Inner {
    free: usize,
    window: usize,
    next_seq: u64,
    /// Slots held per rank (absent when none).
    held: HashMap<u64, usize>,
    /// Waiters, best first. One may be queued while slots are free: its rank is at its
    /// window.
    waiters: BTreeMap<(u64, u64), oneshot::Sender<()>>,
}

impl Inner {
    fn eligible(&self, rank: u64) -> bool {
        self.held.get(&rank).copied().unwrap_or(0) < self.window
    }

    fn take(&mut self, rank: u64) {
        self.free -= 1;
        *self.held.entry(rank).or_insert(0) += 1;
    }

    /// Hand free slots to the best eligible waiters. Sent under the lock, so a cancelled
    /// waiter (see `Waiting::drop`) always knows whether it was granted a slot.
    fn dispatch(&mut self) {
        while self.free > 0 {
            let Some(&key) = self.waiters.keys().find(|(rank, _)| self.eligible(*rank)) else {
                return;
            };
            let Some(tx) = self.waiters.remove(&key) else {
                return;
            };
            self.take(key.0);
            // The receiver lives as long as its queue entry, which was still there, so
            // the send cannot fail; if it ever did, the slot would go back to the pool.
            if tx.send(()).is_err() {
                self.give_back(key.0);
            }
        }
    }

    fn give_back(&mut self, rank: u64) {
        self.free += 1;
        if let Some(n) = self.held.get_mut(&rank) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&rank);
            }
        }
    }
}

/// One held slot; given back (to the best eligible waiter, or to the pool) when dropped.
pub(crate) struct Slot {
    inner: Arc<Mutex<Inner>>,
    rank: u64,
}

fn lock(inner: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    // Nothing panics while holding the lock, and its state is valid after every step.
    inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
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
        let mut g = lock(&self.inner);
        if g.waiters.remove(&self.key).is_none() {
            // Granted after this waiter was cancelled: pass the slot on.
            g.give_back(self.key.0);
            g.dispatch();
        }
    }
}

impl Slots {
    /// A pool of `n` slots, at most `window` (at least 1) of them held by one rank.
    pub(crate) fn new(n: usize, window: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                free: n,
                window: window.max(1),
                next_seq: 0,
                held: HashMap::new(),
                waiters: BTreeMap::new(),
            })),
        }
    }

    /// Wait for a slot. Lower `rank` is served first, equal ranks in arrival order, and a
    /// rank holding `window` slots waits until it gives one back.
    /// Cancel-safe: dropping the future before it resolves never loses a slot.
    pub(crate) async fn acquire(&self, rank: u64) -> Slot {
        let mut waiting = {
            let mut g = lock(&self.inner);
            // Free slots are dispatched the moment they appear, so while one is free no
            // eligible waiter is queued: taking it jumps nobody.
            if g.free > 0 && g.eligible(rank) {
                g.take(rank);
                return Slot {
                    inner: self.inner.clone(),
                    rank,
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
        // The sender is only dropped after sending (see `Inner::dispatch`): resolves Ok.
        let _ = (&mut waiting.rx).await;
        waiting.granted = true;
        Slot {
            inner: self.inner.clone(),
            rank,
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
        let mut g = lock(&self.inner);
        g.give_back(self.rank);
        g.dispatch();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::time::Duration;

    /// Queue `(name, rank)` waiters in this order behind a full pool; return the order in
    /// which they were served once `held` is given back.
    async fn served_order(slots: Arc<Slots>, held: Vec<Slot>, waiters: &[(&'static str, u64)]) -> Vec<&'static str> {
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for &(name, rank) in waiters {
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
        order.lock().unwrap().clone()
    }

    #[tokio::test]
    async fn lowest_rank_first_then_arrival_order() {
        let slots = Arc::new(Slots::new(1, 4));
        let held = vec![slots.acquire(5).await];
        let order = served_order(slots.clone(), held, &[("c3", 3), ("a0", 0), ("d3", 3), ("b1", 1)]).await;
        assert_eq!(order, ["a0", "b1", "c3", "d3"]);
        assert_eq!(slots.free(), 1);
    }

    /// The slot a polled acquire resolved to; panics if it is still waiting.
    fn ready(p: std::task::Poll<Slot>, who: &str) -> Slot {
        match p {
            std::task::Poll::Ready(s) => s,
            std::task::Poll::Pending => panic!("{who} was not served"),
        }
    }

    #[tokio::test]
    async fn a_rank_at_its_window_waits_and_gets_its_own_slot_back_first() {
        // Rank 0 holds its window of 2 out of 3 slots; rank 7 holds the third.
        let slots = Arc::new(Slots::new(3, 2));
        let a = slots.acquire(0).await;
        let b = slots.acquire(0).await;
        let c = slots.acquire(7).await;
        // Rank 0 wants a third: queued although it is the best rank (over its window).
        let mut more = Box::pin(slots.acquire(0));
        assert!(futures::poll!(&mut more).is_pending());
        // Rank 9 queues too. Rank 7 gives its slot back: rank 0 is still at its window,
        // so rank 9 gets it.
        let mut nine = Box::pin(slots.acquire(9));
        assert!(futures::poll!(&mut nine).is_pending());
        drop(c);
        let _nine = ready(futures::poll!(&mut nine), "rank 9");
        // A newcomer of rank 1 queues behind nothing eligible; when rank 0 gives one back,
        // the slot goes to rank 0's waiter (best rank, now under its window), not rank 1.
        let mut one = Box::pin(slots.acquire(1));
        assert!(futures::poll!(&mut one).is_pending());
        drop(a);
        let _more = ready(futures::poll!(&mut more), "rank 0");
        assert!(futures::poll!(&mut one).is_pending());
        drop(b);
        let _one = ready(futures::poll!(&mut one), "rank 1");
        assert_eq!(slots.free(), 0);
    }

    #[tokio::test]
    async fn a_newcomer_does_not_jump_a_better_waiter() {
        // One free slot appears while rank 0 waits: it is dispatched to rank 0 at once, so
        // a later acquire of rank 3 must queue.
        let slots = Arc::new(Slots::new(1, 1));
        let held = slots.acquire(2).await;
        let mut zero = Box::pin(slots.acquire(0));
        assert!(futures::poll!(&mut zero).is_pending());
        drop(held);
        let mut three = Box::pin(slots.acquire(3));
        assert!(futures::poll!(&mut three).is_pending());
        drop(ready(futures::poll!(&mut zero), "rank 0"));
        let _three = ready(futures::poll!(&mut three), "rank 3");
    }

    #[tokio::test]
    async fn cancelled_waiter_loses_no_slot() {
        let slots = Arc::new(Slots::new(2, 2));
        let a = slots.acquire(0).await;
        let b = slots.acquire(0).await;
        // A waiter cancelled while queued.
        let queued = tokio::time::timeout(Duration::from_millis(10), slots.acquire(1)).await;
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
