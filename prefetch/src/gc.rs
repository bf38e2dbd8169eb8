//! Cache lifetime: a node that rolls model versions must not fill its disk. After a
//! successful prefetch the agent removes the views of bundles no longer in its config,
//! once they have been out of it for a grace period (a config rolled back within it finds
//! them still there), and the blobs no view links to and no configured bundle needs, once
//! they are older than the grace period. Every removal is logged by name.
//!
//! When a view was first seen orphaned is kept in `<cache>/gc-state.json` (name → Unix
//! seconds), since nothing on the view itself says when its bundle left the config.
//!
//! What a configured bundle needs is never collected: the blobs its manifest lists and
//! its manifest's own blob (a warm restart reads the manifest from the cache, so a node
//! restarted with the origin down still verifies from disk; see
//! [`crate::PrefetchReport::needed_blobs`]). Partial downloads in `<cache>/tmp/` are
//! collected by the same rule as blobs: a partial (and its chunk map) of a digest no
//! configured bundle needs goes once it has not been written for the grace period; one a
//! configured bundle needs is resumed by the next prefetch.

use crate::cache::{Cache, remove_any};
use crate::error::PrefetchError;
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Largest state file read (a node has a few dozen bundles at most).
const STATE_LIMIT: u64 = 1 << 20;

/// What a garbage collection did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct GcReport {
    /// Bundle views removed (no longer configured for longer than the grace period).
    pub views_removed: Vec<String>,
    /// Blobs removed (sha256 digests): no view links them and no configured bundle needs them.
    pub blobs_removed: Vec<String>,
    /// Partial downloads removed (sha256 digests): no configured bundle needs them.
    pub partials_removed: Vec<String>,
    /// Bytes the removed blobs and partial downloads held.
    pub bytes_freed: u64,
    /// Views no longer configured, kept until their grace period ends: (name, seconds left).
    pub pending: Vec<(String, u64)>,
}

/// Which orphaned views to remove now. `views`: the views in the cache; `keep`: the
/// configured bundles; `since`: when each view was first seen orphaned. Returns the views
/// to remove and the new `since` (configured or removed views leave it; newly orphaned
/// ones enter it at `now`).
pub fn decide_views(
    views: &BTreeSet<String>,
    keep: &BTreeSet<String>,
    since: &BTreeMap<String, u64>,
    now: u64,
    grace: Duration,
) -> (Vec<String>, BTreeMap<String, u64>) {
    let mut remove = Vec::new();
    let mut next = BTreeMap::new();
    for v in views.iter().filter(|v| !keep.contains(*v)) {
        let first = since.get(v).copied().unwrap_or(now).min(now);
        if now.saturating_sub(first) >= grace.as_secs() {
            remove.push(v.clone());
        } else {
            next.insert(v.clone(), first);
        }
    }
    (remove, next)
}

fn now_secs(now: SystemTime) -> u64 {
    now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Collect the cache at `root`: `keep` names the configured bundles, `needed` the blob
/// digests their manifests list. Waits at most 5 s for the cache lock and does nothing
/// while another process holds it longer. Blocking: run it off the async threads.
pub fn collect_garbage(
    root: &Path,
    keep: &BTreeSet<String>,
    needed: &BTreeSet<String>,
    grace: Duration,
    now: SystemTime,
) -> Result<GcReport, PrefetchError> {
    let mut report = GcReport::default();
    if !root.join("bundles").is_dir() {
        return Ok(report);
    }
    let cache = Cache::open(root)?;
    // The prefetch that just ended releases the lock once its download runtime has
    // stopped, on a thread of its own: wait a little for that, never for another writer.
    let mut lock = None;
    for _ in 0..50 {
        lock = cache.try_lock()?;
        if lock.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let Some(_lock) = lock else {
        tracing::info!(cache = %root.display(), "cache busy; garbage collection skipped this time");
        return Ok(report);
    };
    let state_path = root.join("gc-state.json");
    let since: BTreeMap<String, u64> = match crate::cache::read_small(&state_path, STATE_LIMIT) {
        Ok(b) => serde_json::from_slice(&b).unwrap_or_else(|e| {
            tracing::warn!(file = %state_path.display(), error = %e, "unreadable cache GC state; starting it afresh");
            BTreeMap::new()
        }),
        Err(_) => BTreeMap::new(),
    };
    let views: BTreeSet<String> = std::fs::read_dir(cache.bundles_dir())
        .map_err(|e| PrefetchError::io("list", cache.bundles_dir(), e))?
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().into_string().ok())
        // Old generations of a view are not bundles: retired below, when no reader holds them.
        .filter(|name| !name.starts_with(crate::cache::GEN_PREFIX))
        .collect();
    for g in cache.sweep_generations()? {
        tracing::info!(view = %g, cache = %root.display(), "removed an old generation of a bundle view");
    }
    let now_s = now_secs(now);
    let (remove, next) = decide_views(&views, keep, &since, now_s, grace);
    for v in &remove {
        remove_any(&cache.bundles_dir().join(v), true)?;
        tracing::info!(bundle = %v, cache = %root.display(), "removed the view of a bundle no longer configured");
        report.views_removed.push(v.clone());
    }
    report.pending = next
        .iter()
        .map(|(v, first)| (v.clone(), grace.as_secs().saturating_sub(now_s.saturating_sub(*first))))
        .collect();
    // Blobs no view links to (a link count of 1) and no configured bundle needs.
    let blobs = root.join("blobs").join("sha256");
    if let Ok(entries) = std::fs::read_dir(&blobs) {
        let mut entries: Vec<_> = entries.filter_map(Result::ok).collect();
        entries.sort_by_key(std::fs::DirEntry::file_name);
        for e in entries {
            let Ok(digest) = e.file_name().into_string() else {
                continue;
            };
            let Ok(m) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            let old = m
                .modified()
                .ok()
                .is_some_and(|t| now.duration_since(t).is_ok_and(|age| age >= grace));
            if m.is_file() && m.nlink() == 1 && !needed.contains(&digest) && old {
                cache.remove_blob(&digest)?;
                tracing::info!(blob = %digest, bytes = m.len(), cache = %root.display(), "removed a blob no bundle view uses");
                report.bytes_freed += m.len();
                report.blobs_removed.push(digest);
            }
        }
    }
    collect_partials(&cache, needed, grace, now, &mut report)?;
    let text = serde_json::to_vec(&next).unwrap_or_default();
    if let Err(e) = crate::cache::write_nofollow(&state_path, &text) {
        tracing::warn!(file = %state_path.display(), error = %e, "cannot write the cache GC state");
    }
    Ok(report)
}

/// Remove the partial downloads (`tmp/<digest>.part` and its chunk map `.state`) of
/// digests not in `needed` whose newest file is older than `grace`. Call with the lock
/// held: no download is writing them then.
fn collect_partials(
    cache: &Cache,
    needed: &BTreeSet<String>,
    grace: Duration,
    now: SystemTime,
    report: &mut GcReport,
) -> Result<(), PrefetchError> {
    let Ok(entries) = std::fs::read_dir(cache.tmp_dir()) else {
        return Ok(());
    };
    // digest -> (bytes, newest mtime) over its `.part` and `.state`.
    let mut partials: BTreeMap<String, (u64, Option<SystemTime>)> = BTreeMap::new();
    for e in entries.filter_map(Result::ok) {
        let Ok(name) = e.file_name().into_string() else {
            continue;
        };
        let Some(digest) = name.strip_suffix(".part").or_else(|| name.strip_suffix(".state")) else {
            continue;
        };
        // Names the engine made are lower-case hex digests; anything else is not a partial.
        if !crate::manifest::is_sha256_hex(digest) {
            continue;
        }
        let Ok(m) = std::fs::symlink_metadata(e.path()) else {
            continue;
        };
        let entry = partials.entry(digest.to_string()).or_insert((0, None));
        // Allocated bytes: a partial is pre-allocated at its full size.
        entry.0 += m.blocks() * 512;
        entry.1 = entry.1.max(m.modified().ok());
    }
    for (digest, (bytes, newest)) in partials {
        let old = newest.is_none_or(|t| now.duration_since(t).is_ok_and(|age| age >= grace));
        if needed.contains(&digest) || !old {
            continue;
        }
        for p in [cache.part_path(&digest), cache.state_path(&digest)] {
            remove_any(&p, std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir()))?;
        }
        tracing::info!(blob = %digest, bytes, cache = %cache.root().display(), "removed a partial download no configured bundle needs");
        report.bytes_freed += bytes;
        report.partials_removed.push(digest);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::cache::tests::committed;

    fn set(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn views_table() {
        let day = Duration::from_secs(86_400);
        let cases = [
            // (views, keep, since, now, grace, removed, still pending)
            (set(&["a", "b"]), set(&["a", "b"]), vec![], 100, day, vec![], vec![]),
            (
                set(&["a", "old"]),
                set(&["a"]),
                vec![],
                100,
                day,
                vec![],
                vec![("old", 100)],
            ),
            (
                set(&["a", "old"]),
                set(&["a"]),
                vec![("old", 100)],
                100 + 86_399,
                day,
                vec![],
                vec![("old", 100)],
            ),
            (
                set(&["a", "old"]),
                set(&["a"]),
                vec![("old", 100)],
                100 + 86_400,
                day,
                vec!["old"],
                vec![],
            ),
            (set(&["old"]), set(&[]), vec![], 5, Duration::ZERO, vec!["old"], vec![]),
            // Configured again within the grace period: forgotten, not removed.
            (
                set(&["back"]),
                set(&["back"]),
                vec![("back", 1)],
                10_000_000,
                day,
                vec![],
                vec![],
            ),
        ];
        for (views, keep, since, now, grace, removed, pending) in cases {
            let since: BTreeMap<String, u64> = since.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            let (r, next) = decide_views(&views, &keep, &since, now, grace);
            let want_removed: Vec<String> = removed.iter().map(|s| s.to_string()).collect();
            assert_eq!(r, want_removed, "{views:?} {keep:?} now {now}");
            let want: BTreeMap<String, u64> = pending.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            assert_eq!(next, want);
        }
    }

    #[test]
    fn removes_unconfigured_views_and_their_unneeded_blobs_after_the_grace_period() {
        let dir = tempfile::tempdir().unwrap();
        let c = Cache::open(dir.path()).unwrap();
        let kept = committed(&c, b"kept model");
        let old = committed(&c, b"old model");
        let shared = committed(&c, b"shared file");
        let copied = committed(&c, b"a view that is a copy");
        c.link_view("llm-v2", "w.bin", &kept).unwrap();
        c.link_view("llm-v2", "tok.json", &shared).unwrap();
        c.link_view("llm-v1", "w.bin", &old).unwrap();
        c.link_view("llm-v1", "tok.json", &shared).unwrap();
        let keep = set(&["llm-v2"]);
        // `copied` is needed by a configured bundle whose view is a copy: never removed.
        let needed = set(&[&kept, &shared, &copied]);
        let day = Duration::from_secs(86_400);
        let t0 = SystemTime::now();
        // First run: llm-v1 is newly orphaned; nothing goes yet.
        let r = collect_garbage(dir.path(), &keep, &needed, day, t0).unwrap();
        assert!(r.views_removed.is_empty() && r.blobs_removed.is_empty(), "{r:?}");
        assert_eq!(r.pending, vec![("llm-v1".to_string(), 86_400)]);
        assert!(c.bundles_dir().join("llm-v1/w.bin").exists());
        // A day later: the view goes, then the blob only it used; the shared one stays.
        let r = collect_garbage(dir.path(), &keep, &needed, day, t0 + day).unwrap();
        assert_eq!(r.views_removed, vec!["llm-v1".to_string()]);
        assert_eq!(r.blobs_removed, vec![old.clone()]);
        assert_eq!(r.bytes_freed, b"old model".len() as u64);
        assert!(!c.blob_path(&old).exists());
        for d in [&kept, &shared, &copied] {
            assert!(c.blob_path(d).exists(), "{d} kept");
        }
        assert!(c.bundles_dir().join("llm-v2/w.bin").exists());
        assert!(r.pending.is_empty());
    }

    #[test]
    fn a_cache_that_does_not_exist_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let none = dir.path().join("none");
        let r = collect_garbage(&none, &set(&[]), &set(&[]), Duration::ZERO, SystemTime::now()).unwrap();
        assert_eq!(r, GcReport::default());
        assert!(!none.exists());
    }
}
