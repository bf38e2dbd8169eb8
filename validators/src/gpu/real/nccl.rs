//! NCCL loaded by its runtime name, `libnccl.so.2`, with the few symbols the all-reduce
//! uses resolved once, up front.
//!
//! Why not cudarc's NCCL module: its loader tries `libnccl.so`, `libnccl.so.12`, `.11`,
//! ... but never `libnccl.so.2`, the only name NCCL's runtime packages and NVIDIA's wheel
//! ship (`libnccl.so` is the development symlink). It also resolves each symbol on first
//! call and panics when one is missing. Here a missing library or symbol is a plain error
//! ([`NcclLoadError`], reason `NcclMissing`) known before any NCCL call is made; nothing
//! else is treated as "NCCL missing".
//!
//! The symbols (nccl.h, NCCL 2.x ABI): `ncclGetVersion`, `ncclGetErrorString`,
//! `ncclCommInitAll`, `ncclCommDestroy`, `ncclCommGetAsyncError`, `ncclGroupStart`,
//! `ncclGroupEnd`, `ncclAllReduce`. `validators/tests/nccl_wheel.rs` loads NVIDIA's
//! `libnccl.so.2` from the `nvidia-nccl-cu12` wheel through this module.

use libloading::{Library, Symbol};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::{Path, PathBuf};

/// Environment variable naming the NCCL library to load instead of the search below.
pub const NCCL_LIBRARY_ENV: &str = "TAINTGATE_NCCL_LIBRARY";
/// Names tried through the loader's search path, in order.
pub const NCCL_SONAMES: &[&str] = &["libnccl.so.2", "libnccl.so"];
/// Every NCCL symbol the agent uses.
pub const NCCL_SYMBOLS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetErrorString",
    "ncclCommInitAll",
    "ncclCommDestroy",
    "ncclCommGetAsyncError",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclAllReduce",
];

/// `ncclComm_t`.
pub type NcclComm = *mut c_void;
/// `ncclResult_t` (`ncclSuccess` = 0).
pub type NcclResult = c_int;
/// `ncclFloat32` in `ncclDataType_t`.
pub const NCCL_FLOAT32: c_int = 7;
/// `ncclSum` in `ncclRedOp_t`.
pub const NCCL_SUM: c_int = 0;
/// `ncclInProgress` (non-blocking communicators; not used, but not an error either).
const NCCL_IN_PROGRESS: NcclResult = 7;

type GetVersion = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type GetErrorString = unsafe extern "C" fn(NcclResult) -> *const c_char;
type CommInitAll = unsafe extern "C" fn(*mut NcclComm, c_int, *const c_int) -> NcclResult;
type CommDestroy = unsafe extern "C" fn(NcclComm) -> NcclResult;
type CommGetAsyncError = unsafe extern "C" fn(NcclComm, *mut NcclResult) -> NcclResult;
type Group = unsafe extern "C" fn() -> NcclResult;
type AllReduce =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, NcclComm, *mut c_void) -> NcclResult;

/// NCCL could not be loaded: no library under any name tried, or one without a symbol
/// the agent uses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NcclLoadError(pub String);

/// The loaded library with its symbols.
pub struct Nccl {
    path: PathBuf,
    get_version: GetVersion,
    get_error_string: GetErrorString,
    comm_init_all: CommInitAll,
    comm_destroy: CommDestroy,
    comm_get_async_error: CommGetAsyncError,
    group_start: Group,
    group_end: Group,
    all_reduce: AllReduce,
    // Last: the function pointers above point into it.
    _lib: Library,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl").field("path", &self.path).finish_non_exhaustive()
    }
}

/// An NCCL call that failed: the function and NCCL's own text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call}: {message} (ncclResult_t {code})")]
pub struct NcclCallError {
    /// NCCL function.
    pub call: &'static str,
    /// Its result code.
    pub code: NcclResult,
    /// `ncclGetErrorString`.
    pub message: String,
}

#[allow(unsafe_code)]
fn sym<T: Copy>(lib: &Library, path: &Path, name: &str) -> Result<T, NcclLoadError> {
    // SAFETY: the caller names `T` as the C signature nccl.h declares for `name` (the type
    // aliases above); the pointer is used only while `lib` is alive (both live in `Nccl`).
    let s: Symbol<T> = unsafe { lib.get(name.as_bytes()) }
        .map_err(|e| NcclLoadError(format!("{} has no {name}: {e}", path.display())))?;
    Ok(*s)
}

impl Nccl {
    /// Load `$TAINTGATE_NCCL_LIBRARY` if set, else the first of [`NCCL_SONAMES`] the loader
    /// finds.
    pub fn load() -> Result<Self, NcclLoadError> {
        if let Some(p) = std::env::var_os(NCCL_LIBRARY_ENV).filter(|v| !v.is_empty()) {
            return Self::load_from(Path::new(&p));
        }
        let mut tried = Vec::new();
        for name in NCCL_SONAMES {
            match Self::load_from(Path::new(name)) {
                Ok(n) => return Ok(n),
                Err(e) => tried.push(e.0),
            }
        }
        Err(NcclLoadError(format!(
            "libnccl could not be loaded: {}",
            tried.join("; ")
        )))
    }

    /// Load one library (a path, or a bare name through the loader's search path) and
    /// resolve every symbol in [`NCCL_SYMBOLS`].
    #[allow(unsafe_code)]
    pub fn load_from(path: &Path) -> Result<Self, NcclLoadError> {
        // SAFETY: loading runs the library's initialisers; NCCL's do not depend on any
        // state of this process beyond the C runtime.
        let lib = unsafe { Library::new(path.as_os_str()) }
            .map_err(|e| NcclLoadError(format!("cannot load {}: {e}", path.display())))?;
        Ok(Self {
            path: path.to_path_buf(),
            get_version: sym(&lib, path, "ncclGetVersion")?,
            get_error_string: sym(&lib, path, "ncclGetErrorString")?,
            comm_init_all: sym(&lib, path, "ncclCommInitAll")?,
            comm_destroy: sym(&lib, path, "ncclCommDestroy")?,
            comm_get_async_error: sym(&lib, path, "ncclCommGetAsyncError")?,
            group_start: sym(&lib, path, "ncclGroupStart")?,
            group_end: sym(&lib, path, "ncclGroupEnd")?,
            all_reduce: sym(&lib, path, "ncclAllReduce")?,
            _lib: lib,
        })
    }

    /// The library as it was named when loaded.
    pub fn path(&self) -> &Path {
        &self.path
    }

    #[allow(unsafe_code)]
    fn check(&self, call: &'static str, code: NcclResult) -> Result<(), NcclCallError> {
        if code == 0 || code == NCCL_IN_PROGRESS {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static C string for any code.
        let p = unsafe { (self.get_error_string)(code) };
        let message = if p.is_null() {
            "unknown".to_string()
        } else {
            // SAFETY: non-null, NUL-terminated, static (nccl.h).
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        Err(NcclCallError { call, code, message })
    }

    /// `ncclGetVersion`: e.g. 22707 for 2.27.7 (major*10000 + minor*100 + patch).
    #[allow(unsafe_code)]
    pub fn version(&self) -> Result<i32, NcclCallError> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid out-pointer.
        let code = unsafe { (self.get_version)(&mut v) };
        self.check("ncclGetVersion", code)?;
        Ok(v)
    }

    /// `ncclCommInitAll` over CUDA device ordinals; the communicators are destroyed on drop.
    #[allow(unsafe_code)]
    pub fn init_all(&self, ordinals: &[c_int]) -> Result<Comms<'_>, NcclCallError> {
        let n = c_int::try_from(ordinals.len()).unwrap_or(c_int::MAX);
        let mut comms: Vec<NcclComm> = vec![std::ptr::null_mut(); ordinals.len()];
        // SAFETY: `comms` has room for `n` handles and `ordinals` holds `n` device ordinals.
        let code = unsafe { (self.comm_init_all)(comms.as_mut_ptr(), n, ordinals.as_ptr()) };
        self.check("ncclCommInitAll", code)?;
        Ok(Comms { nccl: self, comms })
    }
}

/// Communicators of one `ncclCommInitAll`, destroyed on drop.
pub struct Comms<'a> {
    nccl: &'a Nccl,
    comms: Vec<NcclComm>,
}

impl Comms<'_> {
    /// One float32 sum all-reduce per rank, in one NCCL group. The group is always closed,
    /// also when a rank's call fails: an open group would swallow the next call.
    ///
    /// # Safety
    /// `send[r]` and `recv[r]` must be device pointers to at least `count` f32 on rank `r`'s
    /// device, and `streams[r]` a live stream of that device's context.
    #[allow(unsafe_code)]
    pub unsafe fn all_reduce_f32(
        &self,
        send: &[u64],
        recv: &[u64],
        count: usize,
        streams: &[*mut c_void],
    ) -> Result<(), NcclCallError> {
        let n = &self.nccl;
        // SAFETY: no arguments.
        n.check("ncclGroupStart", unsafe { (n.group_start)() })?;
        let mut first = Ok(());
        for (r, comm) in self.comms.iter().enumerate() {
            let (Some(s), Some(d), Some(st)) = (send.get(r), recv.get(r), streams.get(r)) else {
                first = first.and(Err(NcclCallError {
                    call: "ncclAllReduce",
                    code: -1,
                    message: format!("no buffer or stream for rank {r}"),
                }));
                continue;
            };
            // SAFETY: per this function's contract.
            let code = unsafe {
                (n.all_reduce)(
                    *s as *const c_void,
                    *d as *mut c_void,
                    count,
                    NCCL_FLOAT32,
                    NCCL_SUM,
                    *comm,
                    *st,
                )
            };
            if first.is_ok() {
                first = n.check("ncclAllReduce", code);
            }
        }
        // SAFETY: closes the group opened above.
        let end = n.check("ncclGroupEnd", unsafe { (n.group_end)() });
        first.and(end)
    }

    /// Any asynchronous error a communicator has recorded.
    #[allow(unsafe_code)]
    pub fn async_error(&self) -> Result<(), NcclCallError> {
        for comm in &self.comms {
            let mut e: NcclResult = 0;
            // SAFETY: `comm` is a live communicator; `e` a valid out-pointer.
            let code = unsafe { (self.nccl.comm_get_async_error)(*comm, &mut e) };
            self.nccl.check("ncclCommGetAsyncError", code)?;
            self.nccl.check("ncclCommGetAsyncError (async)", e)?;
        }
        Ok(())
    }
}

impl Drop for Comms<'_> {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        for comm in self.comms.drain(..) {
            if !comm.is_null() {
                // SAFETY: created by ncclCommInitAll, destroyed once.
                let code = unsafe { (self.nccl.comm_destroy)(comm) };
                if let Err(e) = self.nccl.check("ncclCommDestroy", code) {
                    tracing::warn!(error = %e, "NCCL communicator teardown");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn a_missing_library_is_a_load_error_naming_it() {
        let e = Nccl::load_from(Path::new("/nonexistent/libnccl.so.2")).unwrap_err();
        assert!(e.0.contains("/nonexistent/libnccl.so.2"), "{e}");
    }

    #[test]
    fn a_library_without_the_symbols_is_a_load_error_naming_the_symbol() {
        // libc loads but exports no NCCL symbol.
        let e = Nccl::load_from(Path::new("libc.so.6")).unwrap_err();
        assert!(e.0.contains("has no ncclGetVersion"), "{e}");
    }

    #[test]
    fn the_runtime_soname_is_tried_first() {
        assert_eq!(NCCL_SONAMES[0], "libnccl.so.2");
    }
}
