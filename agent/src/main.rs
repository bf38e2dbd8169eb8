//! The `taintgate` binary.
//!
//! It runs on jemalloc rather than glibc's malloc. The model prefetch receives gigabytes
//! through hyper, whose read buffers (a few hundred KiB each) are held until the file's
//! hasher reaches them, so up to `slots × chunk size` of them are alive at once and are
//! freed and reallocated all run long. glibc trims and refaults that memory page by page:
//! about 95 000 page faults per 4 GiB fetch, 8–10 % of the run's samples in zeroing fresh
//! pages. jemalloc with transparent huge pages backs the same churn with a few thousand
//! faults; the A/B is in `bench/results/2026-12-02-prefetch-history.md`.

use clap::Parser;

#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's `malloc_conf`: a C string pointer jemalloc reads once, when it initialises
/// (possibly before `main`), from a symbol of this name (`_rjem_` is the prefix
/// tikv-jemalloc-sys builds jemalloc with on Linux). `MALLOC_CONF`-style overrides still
/// come from the `_RJEM_MALLOC_CONF` environment variable, which jemalloc reads after it.
///
/// - `thp:always`: ask for transparent huge pages (`MADV_HUGEPAGE`) on jemalloc's memory,
///   which is what cuts the prefetch's page faults. A kernel with THP `never` ignores it.
/// - `narenas:1`: one arena. jemalloc's default of four per CPU, each backed by its own
///   huge pages, doubled the resident agent's RSS (18 → 35 MiB in the fleet load test);
///   with one it stays within 2 MiB of glibc's. The agent's allocations are few and large,
///   so one arena costs no measurable contention.
/// - `background_thread:true`: memory freed after a prefetch goes back to the system on
///   jemalloc's decay timer even when the resident agent makes no further allocation
///   (without it, purging only happens inside allocator calls).
#[allow(unsafe_code)] // jemalloc's documented compile-time configuration is a C global.
#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: MallocConf = MallocConf(c"narenas:1,thp:always,background_thread:true".as_ptr());

/// A `const char *` that may live in a `static`.
#[repr(transparent)]
struct MallocConf(*const std::ffi::c_char);

// SAFETY: the pointer is to a `'static` C string literal, never written.
#[allow(unsafe_code)]
unsafe impl Sync for MallocConf {}

#[tokio::main]
async fn main() {
    let cli = taintgate::cli::Cli::parse();
    let code = taintgate::cli::main_with(cli).await;
    std::process::exit(code);
}
