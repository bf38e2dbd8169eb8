//! One retry policy type for every retry loop of the agent and the download engine (the
//! stage executor, the Node watch, the untaint, image pulls, object downloads, the XID
//! watch). Each loop keeps its own numbers; they share the shape: exponential backoff from
//! `min` doubling up to `max`, with jitter (so a fleet that failed together does not retry
//! together), and an optional cap on the number of retries.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// Exponential backoff with jitter between `min` and `max`, at most `times` retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// First delay.
    pub min: Duration,
    /// Largest delay (the doubling stops here).
    pub max: Duration,
    /// Retries after the first attempt; `None`: the caller's deadline bounds them.
    pub times: Option<usize>,
    /// Randomise each delay (on by default; off only where a test needs exact delays).
    pub jitter: bool,
}

impl RetryPolicy {
    /// Unbounded retries from `min` up to `max`, jittered.
    pub const fn new(min: Duration, max: Duration) -> Self {
        Self {
            min,
            max,
            times: None,
            jitter: true,
        }
    }

    /// At most `n` retries.
    pub const fn with_max_times(mut self, n: usize) -> Self {
        self.times = Some(n);
        self
    }

    /// Exact delays (no jitter).
    pub const fn without_jitter(mut self) -> Self {
        self.jitter = false;
        self
    }

    /// The policy as a backon builder (for `Retryable::retry`).
    pub fn builder(&self) -> ExponentialBuilder {
        let b = ExponentialBuilder::default()
            .with_min_delay(self.min)
            .with_max_delay(self.max);
        let b = if self.jitter { b.with_jitter() } else { b };
        match self.times {
            Some(n) => b.with_max_times(n),
            None => b.without_max_times(),
        }
    }

    /// The delays, one per retry (ends after `times` retries when capped).
    pub fn backoff(&self) -> ExponentialBackoff {
        self.builder().build()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_from_min_to_max_and_stop_at_the_cap() {
        let p = RetryPolicy::new(Duration::from_millis(100), Duration::from_millis(500))
            .with_max_times(5)
            .without_jitter();
        let d: Vec<u128> = p.backoff().map(|d| d.as_millis()).collect();
        assert_eq!(d, vec![100, 200, 400, 500, 500]);
    }

    #[test]
    fn jitter_stays_within_one_more_delay_and_unbounded_does_not_end() {
        let p = RetryPolicy::new(Duration::from_millis(100), Duration::from_secs(1));
        let d: Vec<Duration> = p.backoff().take(50).collect();
        assert_eq!(d.len(), 50);
        // backon's jitter adds up to one more delay to each.
        assert!(
            d.iter()
                .all(|x| *x >= Duration::from_millis(100) && *x <= Duration::from_secs(2)),
            "{d:?}"
        );
    }
}
