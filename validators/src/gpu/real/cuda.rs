//! The smoke and peer-bw stages over the CUDA driver API (`cudarc`, `libcuda.so.1` loaded
//! at run time) and NCCL ([`super::nccl`], `libnccl.so.2`). This code runs only inside the
//! short-lived CUDA worker process ([`super::worker`]), never in the resident agent.
//!
//! Loading: cudarc's dynamic loading panics when a library or symbol is missing. So the
//! library is first probed with cudarc's own `is_culib_present` (a plain dlopen that returns
//! false), which turns "no driver" into a typed error; every CUDA section also runs under
//! `catch_unwind` as the last resort for a driver too old to export a symbol the bindings
//! (cuda-12020) resolve, turning that panic into a `Cuda` error naming the GPU. NCCL is
//! loaded with every symbol resolved up front, so only a load failure means "NCCL missing".
//!
//! Kernels: `validators/kernels/smoke.ptx`, hand-written PTX the driver JITs (no toolkit,
//! no NVRTC on the node); a JIT failure reports the driver's error log.
//!
//! Peer copies use `cuMemAlloc` buffers, not cudarc's stream-ordered (`cuMemAllocAsync`)
//! ones: `cuCtxEnablePeerAccess` grants peers access to `cuMemAlloc` memory only (pool
//! memory needs `cuMemPoolSetAccess`), and without access `cuMemcpyPeerAsync` stages the
//! copy through host memory.

use crate::gpu::decide::allreduce_busbw_gbps;
use crate::gpu::{
    DomainBandwidth, GpuError, GpuInfo, Inventory, PairBandwidth, PeerBwOptions, PeerDomain, SmokeResult,
};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg,
};
use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The embedded smoke kernels.
pub const SMOKE_PTX: &str = include_str!("../../../kernels/smoke.ptx");

/// Constants of the `transform` kernel (a 32-bit LCG step).
const MUL: u32 = 1_664_525;
const ADD: u32 = 1_013_904_223;
/// Threads per block for every kernel.
const BLOCK: u32 = 256;
/// All-reduce iterations before timing starts (NCCL sets up its channels on the first).
const ALLREDUCE_WARMUP: u32 = 2;

/// Expected element `i` after `fill(seed)` then `transform`.
pub fn expected_element(i: u64, seed: u32) -> u32 {
    ((i as u32) ^ seed).wrapping_mul(MUL).wrapping_add(ADD)
}

/// Seed per GPU so that a buffer left over from another GPU's run cannot pass.
pub fn seed_for(index: u32) -> u32 {
    0x9e37_79b9_u32.wrapping_mul(index.wrapping_add(1))
}

/// Format a CUDA UUID (16 bytes) the way NVML prints it, with NVML's prefix for the kind
/// of device (`GPU-` for a GPU, `MIG-` for a MIG instance):
/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn format_uuid_with(prefix: &str, bytes: &[u8; 16]) -> String {
    let h: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{prefix}-{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

/// [`format_uuid_with`] for a GPU (`GPU-`).
pub fn format_uuid(bytes: &[u8; 16]) -> String {
    format_uuid_with("GPU", bytes)
}

/// Text of a panic payload.
fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic without message".to_string()
    }
}

/// Is `libcuda` loadable at all?
#[allow(unsafe_code)]
fn cuda_library_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on cudarc's candidate names and drops
    // what it opened; it runs no library code besides the loader's initialisers.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Why `libcuda.so.1` does not load, in the loader's words: absent, or present but missing
/// a library it needs (an image without `libpthread.so.0` fails here, not at `cuInit`).
#[allow(unsafe_code)]
fn cuda_load_error() -> String {
    // SAFETY: as in `cuda_library_present`: a `dlopen` of the driver's soname, dropped at
    // once; no library function is called.
    match unsafe { libloading::Library::new("libcuda.so.1") } {
        Ok(_) => "it loads by its soname but not by cudarc's candidate names".into(),
        Err(e) => e.to_string(),
    }
}

fn cuda_err(call: &str, gpu: &str, e: DriverError) -> GpuError {
    GpuError::Cuda {
        call: call.into(),
        gpu: gpu.into(),
        message: format!("{e:?}"),
    }
}

/// A CUDA failure during peer-bw is a peer-bw failure, not a smoke failure.
pub(crate) fn as_peer(e: GpuError) -> GpuError {
    match e {
        GpuError::Cuda { call, gpu, message } => GpuError::PeerCuda { call, gpu, message },
        other => other,
    }
}

/// A context with the smoke module loaded.
struct Loaded {
    ctx: Arc<CudaContext>,
    module: Arc<CudaModule>,
}

impl Loaded {
    /// Errors cudarc recorded from deferred work (frees, event waits in drops) are
    /// reported here, against the section that caused them, not the next call.
    fn check_deferred(&self, section: &str, id: &str) -> Result<(), GpuError> {
        self.ctx
            .check_err()
            .map_err(|e| cuda_err(&format!("{section} (deferred cleanup)"), id, e))
    }
}

/// CUDA state of one worker run: UUID -> ordinal map and the contexts it loaded.
pub(crate) struct CudaBackend {
    ordinals: BTreeMap<String, usize>,
    loaded: Mutex<BTreeMap<usize, Arc<Loaded>>>,
}

impl CudaBackend {
    /// Load the driver, initialise it and map CUDA ordinals to NVML UUIDs (CUDA's default
    /// order is fastest-first, not PCI order, so indexes cannot be assumed to agree).
    pub(crate) fn open() -> Result<Self, GpuError> {
        if !cuda_library_present() {
            return Err(GpuError::DriverNotLoaded(format!(
                "libcuda.so.1 could not be loaded: {}",
                cuda_load_error()
            )));
        }
        guarded("cuInit", "-", || {
            cudarc::driver::result::init().map_err(|e| cuda_err("cuInit", "-", e))?;
            let count =
                cudarc::driver::result::device::get_count().map_err(|e| cuda_err("cuDeviceGetCount", "-", e))?;
            let mut ordinals = BTreeMap::new();
            for o in 0..count {
                let dev =
                    cudarc::driver::result::device::get(o).map_err(|e| cuda_err("cuDeviceGet", &o.to_string(), e))?;
                let uuid = cudarc::driver::result::device::get_uuid(dev)
                    .map_err(|e| cuda_err("cuDeviceGetUuid", &o.to_string(), e))?;
                let bytes: [u8; 16] = uuid.bytes.map(|b| b as u8);
                ordinals.insert(format_uuid(&bytes), o as usize);
            }
            Ok(Self {
                ordinals,
                loaded: Mutex::new(BTreeMap::new()),
            })
        })
    }

    fn ordinal(&self, gpu: &GpuInfo) -> Result<usize, GpuError> {
        self.ordinals.get(&gpu.uuid).copied().ok_or_else(|| GpuError::Cuda {
            call: "cuDeviceGetUuid".into(),
            gpu: gpu.uuid.clone(),
            message: format!(
                "CUDA does not see this GPU (visible: {:?}); check CUDA_VISIBLE_DEVICES",
                self.ordinals.keys().collect::<Vec<_>>()
            ),
        })
    }

    /// The ordinal to run on: the GPU's by UUID, or, when the parent restricted CUDA to one
    /// device (a MIG instance through `CUDA_VISIBLE_DEVICES`), the only one visible.
    fn target(&self, gpu: &GpuInfo, only_visible: bool) -> Result<usize, GpuError> {
        if !only_visible {
            return self.ordinal(gpu);
        }
        match self.ordinals.values().copied().collect::<Vec<_>>().as_slice() {
            [one] => Ok(*one),
            other => Err(GpuError::Cuda {
                call: "cuDeviceGetCount".into(),
                gpu: gpu.uuid.clone(),
                message: format!(
                    "expected exactly one CUDA device under CUDA_VISIBLE_DEVICES={:?}, found {}",
                    std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default(),
                    other.len()
                ),
            }),
        }
    }

    fn load(&self, gpu: &GpuInfo) -> Result<Arc<Loaded>, GpuError> {
        let ordinal = self.ordinal(gpu)?;
        self.load_ordinal(ordinal, &gpu.uuid)
    }

    fn load_ordinal(&self, ordinal: usize, id: &str) -> Result<Arc<Loaded>, GpuError> {
        let mut cache = self.loaded.lock().map_err(|_| GpuError::Cuda {
            call: "context cache".into(),
            gpu: id.into(),
            message: "lock poisoned".into(),
        })?;
        if let Some(l) = cache.get(&ordinal) {
            return Ok(l.clone());
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("cuDevicePrimaryCtxRetain", id, e))?;
        let module = match ctx.load_module(cudarc::nvrtc::Ptx::from_src(SMOKE_PTX)) {
            Ok(m) => m,
            Err(e) => {
                let log = jit_error_log(&ctx);
                return Err(GpuError::Cuda {
                    call: "cuModuleLoadData".into(),
                    gpu: id.into(),
                    message: format!("{e:?}; PTX JIT log: {}", log.unwrap_or_else(|| "(empty)".into())),
                });
            }
        };
        let l = Arc::new(Loaded { ctx, module });
        cache.insert(ordinal, l.clone());
        Ok(l)
    }

    /// Fill, transform and verify a buffer of `bytes` on one GPU (or on the one visible
    /// device, a MIG instance, with `only_visible`).
    pub(crate) fn smoke(&self, gpu: &GpuInfo, bytes: u64, only_visible: bool) -> Result<SmokeResult, GpuError> {
        let start = Instant::now();
        guarded("smoke", &gpu.uuid, || self.smoke_inner(gpu, bytes, only_visible))?;
        Ok(SmokeResult {
            index: gpu.index,
            uuid: gpu.uuid.clone(),
            bytes,
            duration: start.elapsed(),
        })
    }

    fn smoke_inner(&self, gpu: &GpuInfo, bytes: u64, only_visible: bool) -> Result<(), GpuError> {
        let id = gpu.uuid.as_str();
        let n = (bytes / 4).max(1);
        let len = usize::try_from(n).map_err(|_| GpuError::Cuda {
            call: "cuMemAlloc".into(),
            gpu: id.into(),
            message: format!("{bytes} bytes do not fit this host's address space"),
        })?;
        let l = self.load_ordinal(self.target(gpu, only_visible)?, id)?;
        let stream = l.ctx.default_stream();
        let f = |name: &str| {
            l.module
                .load_function(name)
                .map_err(|e| cuda_err(&format!("cuModuleGetFunction({name})"), id, e))
        };
        let (fill, transform, verify) = (f("fill")?, f("transform")?, f("verify")?);
        let cfg = launch_config(&l.ctx, n, id)?;
        let seed = seed_for(gpu.index);
        let buf = RawBuf::new(&l.ctx, len * 4, id)?;
        let mut out = stream
            .clone_htod(&[0u64, u64::MAX])
            .map_err(|e| cuda_err("cuMemcpyHtoD", id, e))?;
        launch_fill(&stream, &fill, buf.ptr, n, seed, cfg, id)?;
        launch_transform(&stream, &transform, buf.ptr, n, cfg, id)?;
        launch_verify(&stream, &verify, buf.ptr, n, seed, &mut out, cfg, id)?;
        stream
            .synchronize()
            .map_err(|e| cuda_err("cuStreamSynchronize", id, e))?;
        let counts = stream.clone_dtoh(&out).map_err(|e| cuda_err("cuMemcpyDtoH", id, e))?;
        let (mismatches, first) = (
            counts.first().copied().unwrap_or(u64::MAX),
            counts.get(1).copied().unwrap_or(0),
        );
        if mismatches != 0 {
            return Err(GpuError::SmokeMismatch {
                gpu: id.into(),
                detail: format!(
                    "{mismatches} of {n} elements wrong (device check); first at element {first}, expected {:#010x}",
                    expected_element(first, seed)
                ),
            });
        }
        // Host spot check: the device verdict must agree with what the host reads back.
        let window = 4096u64.min(n);
        for start in [0, n / 2, n - window] {
            let host = buf.read_u32(&stream, start, window as usize, id)?;
            for (k, got) in host.iter().enumerate() {
                let i = start + k as u64;
                let want = expected_element(i, seed);
                if *got != want {
                    return Err(GpuError::SmokeMismatch {
                        gpu: id.into(),
                        detail: format!("element {i}: expected {want:#010x}, got {got:#010x} (host spot check)"),
                    });
                }
            }
        }
        drop(out);
        drop(buf);
        l.check_deferred("smoke", id)
    }

    /// Peer copy matrix (and the NCCL all-reduce when NCCL loads) for one domain.
    pub(crate) fn peer_bandwidth(
        &self,
        inventory: &Inventory,
        domain: &PeerDomain,
        opts: &PeerBwOptions,
    ) -> Result<DomainBandwidth, GpuError> {
        let gpus: Vec<&GpuInfo> = domain
            .gpus
            .iter()
            .map(|i| {
                inventory
                    .gpus
                    .iter()
                    .find(|g| g.index == *i)
                    .ok_or_else(|| GpuError::Nccl {
                        domain: domain.id,
                        message: format!("GPU {i} is in the domain but not in the inventory"),
                    })
            })
            .collect::<Result<_, _>>()?;
        if gpus.len() < 2 {
            // Nothing to copy to: the stage reports the single-GPU outcome; never "min inf".
            return Ok(DomainBandwidth {
                domain: domain.id,
                pairs: Vec::new(),
                allreduce_busbw_gbps: None,
                allreduce_skipped: Some("single-GPU domain: no peer to measure".into()),
            });
        }
        let label = format!("domain {}", domain.id);
        let pairs = guarded("cuMemcpyPeerAsync", &label, || self.copy_matrix(&gpus, opts)).map_err(as_peer)?;
        let (allreduce_busbw_gbps, allreduce_skipped) = match super::nccl::Nccl::load() {
            Err(e) => {
                let msg = e.0;
                if opts.require_nccl {
                    return Err(GpuError::NcclMissing(msg));
                }
                tracing::warn!(domain = domain.id, "{msg}; peer bandwidth from the copy matrix only");
                (None, Some(format!("{msg}; copy matrix only")))
            }
            Ok(nccl) => {
                // A panic here is a bug or a driver fault, not a missing library: an error.
                let r = guarded("ncclAllReduce", &label, || {
                    self.allreduce(&nccl, &gpus, domain.id, opts)
                })
                .map_err(as_peer)?;
                (Some(r), None)
            }
        };
        Ok(DomainBandwidth {
            domain: domain.id,
            pairs,
            allreduce_busbw_gbps,
            allreduce_skipped,
        })
    }

    fn copy_matrix(&self, gpus: &[&GpuInfo], opts: &PeerBwOptions) -> Result<Vec<PairBandwidth>, GpuError> {
        let n = (opts.bytes / 4).max(1);
        let len = usize::try_from(n).unwrap_or(usize::MAX / 4);
        let bytes = len * 4;
        let loaded: Vec<Arc<Loaded>> = gpus.iter().map(|g| self.load(g)).collect::<Result<_, _>>()?;
        // Direct peer access where the hardware allows it; otherwise the copy is staged
        // through host memory, which the pair's `direct: false` reports (PeerNotDirect).
        // `direct[x][y]`: x's context may read and write y's memory.
        let mut direct = vec![vec![false; loaded.len()]; loaded.len()];
        for (a, la) in loaded.iter().enumerate() {
            for (b, lb) in loaded.iter().enumerate() {
                if a != b {
                    direct[a][b] = enable_peer_access(la, lb, &gpus[a].uuid)?;
                    tracing::info!(
                        src = gpus[b].index,
                        dst = gpus[a].index,
                        direct = direct[a][b],
                        "peer access"
                    );
                }
            }
        }
        // Sources hold the smoke pattern of their GPU's seed, so a copy that delivers
        // zeros, stale data or another GPU's buffer fails the check on the destination.
        let mut src = Vec::new();
        let mut dst = Vec::new();
        let mut streams = Vec::new();
        for (l, g) in loaded.iter().zip(gpus) {
            let id = g.uuid.as_str();
            let s = l.ctx.new_stream().map_err(|e| cuda_err("cuStreamCreate", id, e))?;
            let f = |name: &str| {
                l.module
                    .load_function(name)
                    .map_err(|e| cuda_err(&format!("cuModuleGetFunction({name})"), id, e))
            };
            let cfg = launch_config(&l.ctx, n, id)?;
            let b = RawBuf::new(&l.ctx, bytes, id)?;
            launch_fill(&s, &f("fill")?, b.ptr, n, seed_for(g.index), cfg, id)?;
            launch_transform(&s, &f("transform")?, b.ptr, n, cfg, id)?;
            s.synchronize().map_err(|e| cuda_err("cuStreamSynchronize", id, e))?;
            src.push(b);
            dst.push(RawBuf::new(&l.ctx, bytes, id)?);
            streams.push(s);
        }
        let mut pairs = Vec::new();
        for a in 0..gpus.len() {
            for b in 0..gpus.len() {
                if a == b {
                    continue;
                }
                let stream = &streams[b];
                let id = &gpus[b].uuid;
                let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
                let mut samples = Vec::new();
                // One warm-up copy, then the measured ones.
                for it in 0..=opts.iterations.max(1) {
                    let t0 = loaded[b]
                        .ctx
                        .new_event(timing)
                        .map_err(|e| cuda_err("cuEventCreate", id, e))?;
                    let t1 = loaded[b]
                        .ctx
                        .new_event(timing)
                        .map_err(|e| cuda_err("cuEventCreate", id, e))?;
                    t0.record(stream).map_err(|e| cuda_err("cuEventRecord", id, e))?;
                    copy_peer(&src[a], &dst[b], stream, id)?;
                    t1.record(stream).map_err(|e| cuda_err("cuEventRecord", id, e))?;
                    t1.synchronize().map_err(|e| cuda_err("cuEventSynchronize", id, e))?;
                    let ms = t0.elapsed_ms(&t1).map_err(|e| cuda_err("cuEventElapsedTime", id, e))?;
                    if it > 0 {
                        samples.push(crate::gpu::decide::algbw_gbps(bytes as u64, f64::from(ms) / 1e3));
                    }
                }
                // Verify on the destination device: every element is the source's pattern.
                let verify = loaded[b]
                    .module
                    .load_function("verify")
                    .map_err(|e| cuda_err("cuModuleGetFunction(verify)", id, e))?;
                let mut out = stream
                    .clone_htod(&[0u64, u64::MAX])
                    .map_err(|e| cuda_err("cuMemcpyHtoD", id, e))?;
                let seed = seed_for(gpus[a].index);
                let cfg = launch_config(&loaded[b].ctx, n, id)?;
                launch_verify(stream, &verify, dst[b].ptr, n, seed, &mut out, cfg, id)?;
                let counts = stream.clone_dtoh(&out).map_err(|e| cuda_err("cuMemcpyDtoH", id, e))?;
                let (bad, first) = (
                    counts.first().copied().unwrap_or(u64::MAX),
                    counts.get(1).copied().unwrap_or(0),
                );
                if bad != 0 {
                    return Err(GpuError::PeerCopyMismatch {
                        src: gpus[a].index,
                        dst: gpus[b].index,
                        detail: format!(
                            "{bad} of {n} elements differ from the source's pattern; first at element {first} (expected {:#010x})",
                            expected_element(first, seed)
                        ),
                    });
                }
                pairs.push(PairBandwidth {
                    src: gpus[a].index,
                    dst: gpus[b].index,
                    gbps: median(&mut samples),
                    // The copy runs on the destination's stream, reading the source's memory.
                    direct: direct[b][a],
                });
            }
        }
        drop(src);
        drop(dst);
        for (l, g) in loaded.iter().zip(gpus) {
            l.check_deferred("copy matrix", &g.uuid)?;
        }
        Ok(pairs)
    }

    #[allow(unsafe_code)]
    fn allreduce(
        &self,
        nccl: &super::nccl::Nccl,
        gpus: &[&GpuInfo],
        domain: u32,
        opts: &PeerBwOptions,
    ) -> Result<f64, GpuError> {
        let nerr = |e: super::nccl::NcclCallError| GpuError::Nccl {
            domain,
            message: e.to_string(),
        };
        let n = (opts.bytes / 4).max(1);
        let len = usize::try_from(n).unwrap_or(usize::MAX / 4);
        let loaded: Vec<Arc<Loaded>> = gpus.iter().map(|g| self.load(g)).collect::<Result<_, _>>()?;
        let ordinals: Vec<i32> = gpus
            .iter()
            .map(|g| self.ordinal(g).map(|o| i32::try_from(o).unwrap_or(i32::MAX)))
            .collect::<Result<_, _>>()?;
        let streams: Vec<Arc<CudaStream>> = loaded
            .iter()
            .zip(gpus)
            .map(|(l, g)| l.ctx.new_stream().map_err(|e| cuda_err("cuStreamCreate", &g.uuid, e)))
            .collect::<Result<_, _>>()?;
        let comms = nccl.init_all(&ordinals).map_err(nerr)?;
        let mut send = Vec::new();
        let mut recv = Vec::new();
        for (r, (l, g)) in loaded.iter().zip(gpus).enumerate() {
            let s = &streams[r];
            let fill = l
                .module
                .load_function("fill_f32")
                .map_err(|e| cuda_err("cuModuleGetFunction(fill_f32)", &g.uuid, e))?;
            let b = RawBuf::new(&l.ctx, len * 4, &g.uuid)?;
            launch_fill_f32(
                s,
                &fill,
                b.ptr,
                n,
                (r + 1) as f32,
                launch_config(&l.ctx, n, &g.uuid)?,
                &g.uuid,
            )?;
            send.push(b);
            recv.push(RawBuf::new(&l.ctx, len * 4, &g.uuid)?);
        }
        for (s, g) in streams.iter().zip(gpus) {
            s.synchronize()
                .map_err(|e| cuda_err("cuStreamSynchronize", &g.uuid, e))?;
        }
        let send_ptrs: Vec<u64> = send.iter().map(|b| b.ptr).collect();
        let recv_ptrs: Vec<u64> = recv.iter().map(|b| b.ptr).collect();
        let raw_streams: Vec<*mut std::ffi::c_void> = streams.iter().map(|s| s.cu_stream().cast()).collect();
        let run = |times: u32| -> Result<(), GpuError> {
            for _ in 0..times {
                // SAFETY: each rank's send/recv buffers hold `len` f32 on its device and
                // its stream belongs to that device's context; all stay alive until the
                // streams are synchronised below.
                let r = unsafe { comms.all_reduce_f32(&send_ptrs, &recv_ptrs, len, &raw_streams) };
                r.map_err(nerr)?;
            }
            Ok(())
        };
        // Warm-up (NCCL connects its channels on the first call), then back-to-back
        // iterations timed on the device, as nccl-tests does: no host sync between them.
        run(ALLREDUCE_WARMUP)?;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut marks = Vec::new();
        for (r, (l, g)) in loaded.iter().zip(gpus).enumerate() {
            let t0 = l
                .ctx
                .new_event(timing)
                .map_err(|e| cuda_err("cuEventCreate", &g.uuid, e))?;
            t0.record(&streams[r])
                .map_err(|e| cuda_err("cuEventRecord", &g.uuid, e))?;
            marks.push(t0);
        }
        let iters = opts.iterations.max(1);
        run(iters)?;
        let mut slowest_ms = 0f32;
        for (r, (l, g)) in loaded.iter().zip(gpus).enumerate() {
            let t1 = l
                .ctx
                .new_event(timing)
                .map_err(|e| cuda_err("cuEventCreate", &g.uuid, e))?;
            t1.record(&streams[r])
                .map_err(|e| cuda_err("cuEventRecord", &g.uuid, e))?;
            t1.synchronize()
                .map_err(|e| cuda_err("cuEventSynchronize", &g.uuid, e))?;
            let ms = marks[r]
                .elapsed_ms(&t1)
                .map_err(|e| cuda_err("cuEventElapsedTime", &g.uuid, e))?;
            slowest_ms = slowest_ms.max(ms);
        }
        comms.async_error().map_err(nerr)?;
        // Result check: every element is the sum of 1..=ranks on every rank.
        let ranks = gpus.len();
        let want = (ranks * (ranks + 1) / 2) as f32;
        for (r, (l, g)) in loaded.iter().zip(gpus).enumerate() {
            let s = &streams[r];
            let count = l
                .module
                .load_function("count_ne_f32")
                .map_err(|e| cuda_err("cuModuleGetFunction(count_ne_f32)", &g.uuid, e))?;
            let mut out = s
                .alloc_zeros::<u64>(1)
                .map_err(|e| cuda_err("cuMemAlloc", &g.uuid, e))?;
            launch_count_ne(
                s,
                &count,
                recv[r].ptr,
                n,
                want,
                &mut out,
                launch_config(&l.ctx, n, &g.uuid)?,
                &g.uuid,
            )?;
            let bad = s.clone_dtoh(&out).map_err(|e| cuda_err("cuMemcpyDtoH", &g.uuid, e))?;
            if bad.first().copied().unwrap_or(u64::MAX) != 0 {
                return Err(GpuError::Nccl {
                    domain,
                    message: format!(
                        "all-reduce result wrong on GPU {} ({}): {:?} elements differ from {want}",
                        g.index, g.uuid, bad
                    ),
                });
            }
        }
        drop(comms);
        drop(send);
        drop(recv);
        for (l, g) in loaded.iter().zip(gpus) {
            l.check_deferred("all-reduce", &g.uuid)?;
        }
        let per_iter_s = f64::from(slowest_ms) / 1e3 / f64::from(iters);
        Ok(allreduce_busbw_gbps((len * 4) as u64, per_iter_s, ranks as u32))
    }
}

/// Device memory from `cuMemAlloc` (never a stream-ordered pool, so peer access applies),
/// freed with `cuMemFree` on drop.
struct RawBuf {
    ctx: Arc<CudaContext>,
    ptr: u64,
    bytes: usize,
}

impl RawBuf {
    #[allow(unsafe_code)]
    fn new(ctx: &Arc<CudaContext>, bytes: usize, id: &str) -> Result<Self, GpuError> {
        ctx.bind_to_thread().map_err(|e| cuda_err("cuCtxSetCurrent", id, e))?;
        // SAFETY: the context is current on this thread; the memory is written by a kernel
        // or a copy before anything reads it.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes) }.map_err(|e| cuda_err("cuMemAlloc", id, e))?;
        Ok(Self {
            ctx: ctx.clone(),
            ptr,
            bytes,
        })
    }

    /// Read `count` u32 from element `start` (synchronous).
    #[allow(unsafe_code)]
    fn read_u32(&self, stream: &Arc<CudaStream>, start: u64, count: usize, id: &str) -> Result<Vec<u32>, GpuError> {
        stream
            .synchronize()
            .map_err(|e| cuda_err("cuStreamSynchronize", id, e))?;
        let mut host = vec![0u32; count];
        let off = start.saturating_mul(4);
        if off.saturating_add(count as u64 * 4) > self.bytes as u64 {
            return Err(cuda_err(
                "cuMemcpyDtoH",
                id,
                DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_VALUE),
            ));
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("cuCtxSetCurrent", id, e))?;
        // SAFETY: the range [off, off + count*4) lies inside this allocation (checked
        // above); `host` has room for `count` u32; the stream was synchronised, so no
        // kernel writes the range meanwhile.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut host, self.ptr + off) }
            .map_err(|e| cuda_err("cuMemcpyDtoH", id, e))?;
        Ok(host)
    }
}

impl Drop for RawBuf {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by cuMemAlloc in this context and freed once; cuMemFree
            // waits for work using it to finish.
            if let Err(e) = unsafe { cudarc::driver::result::free_sync(self.ptr) } {
                self.ctx.record_err::<()>(Err(e));
            }
        }
    }
}

/// `cuMemcpyPeerAsync` of the whole of `src` into `dst` on `stream` (the destination's).
#[allow(unsafe_code)]
fn copy_peer(src: &RawBuf, dst: &RawBuf, stream: &Arc<CudaStream>, id: &str) -> Result<(), GpuError> {
    let bytes = src.bytes.min(dst.bytes);
    dst.ctx
        .bind_to_thread()
        .map_err(|e| cuda_err("cuCtxSetCurrent", id, e))?;
    // SAFETY: both allocations are live and at least `bytes` long; the stream belongs to
    // the destination's context.
    unsafe {
        cudarc::driver::result::memcpy_peer_async(
            dst.ctx.cu_ctx(),
            dst.ptr,
            src.ctx.cu_ctx(),
            src.ptr,
            bytes,
            stream.cu_stream(),
        )
    }
    .map_err(|e| cuda_err("cuMemcpyPeerAsync", id, e))
}

/// The driver's JIT error log for the smoke PTX, read by loading it again with
/// `cuModuleLoadDataEx` and a log buffer (cudarc's loader passes none). Only called after
/// a failed load.
#[allow(unsafe_code)]
fn jit_error_log(ctx: &Arc<CudaContext>) -> Option<String> {
    use cudarc::driver::sys;
    let ptx = std::ffi::CString::new(SMOKE_PTX).ok()?;
    ctx.bind_to_thread().ok()?;
    let mut log = vec![0u8; 16 * 1024];
    let mut options = [
        sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    let mut values: [*mut std::ffi::c_void; 2] = [log.as_mut_ptr().cast(), log.len() as *mut std::ffi::c_void];
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: the context is current; `ptx` is NUL-terminated; options and values are two
    // matching entries (a buffer and its size, the size passed by value as the pointer,
    // as the driver API specifies); `log` outlives the call.
    let r = unsafe {
        sys::cuModuleLoadDataEx(
            &mut module,
            ptx.as_ptr().cast(),
            options.len() as u32,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    };
    if r == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: loaded just now, unloaded once.
        let _ = unsafe { sys::cuModuleUnload(module) };
        return None;
    }
    let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
    let text = String::from_utf8_lossy(&log[..end]).trim().to_string();
    (!text.is_empty()).then_some(text)
}

/// Median of samples (0 when empty).
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Run a CUDA section, turning a panic from cudarc's loader (missing symbol) into an error.
fn guarded<T>(call: &str, gpu: &str, f: impl FnOnce() -> Result<T, GpuError>) -> Result<T, GpuError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => Err(GpuError::Cuda {
            call: call.into(),
            gpu: gpu.into(),
            message: panic_text(p),
        }),
    }
}

fn launch_config(ctx: &Arc<CudaContext>, n: u64, id: &str) -> Result<LaunchConfig, GpuError> {
    let sms = ctx
        .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| cuda_err("cuDeviceGetAttribute", id, e))?;
    let needed = n.div_ceil(u64::from(BLOCK));
    let cap = u64::from(sms.max(1) as u32) * 32;
    let blocks = needed.clamp(1, cap) as u32;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

#[allow(unsafe_code)]
fn launch_fill(
    s: &Arc<CudaStream>,
    f: &CudaFunction,
    buf: u64,
    n: u64,
    seed: u32,
    cfg: LaunchConfig,
    id: &str,
) -> Result<(), GpuError> {
    let mut b = s.launch_builder(f);
    b.arg(&buf).arg(&n).arg(&seed);
    // SAFETY: `fill(.u64 buf, .u64 n, .u32 seed)` in smoke.ptx takes exactly these argument
    // types in this order and writes only elements [0, n) of `buf`, a device allocation of
    // at least n u32 on the stream's device (callers allocate n * 4 bytes).
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| cuda_err("cuLaunchKernel(fill)", id, e))
}

#[allow(unsafe_code)]
fn launch_transform(
    s: &Arc<CudaStream>,
    f: &CudaFunction,
    buf: u64,
    n: u64,
    cfg: LaunchConfig,
    id: &str,
) -> Result<(), GpuError> {
    let mut b = s.launch_builder(f);
    b.arg(&buf).arg(&n);
    // SAFETY: `transform(.u64 buf, .u64 n)` reads and writes elements [0, n) of `buf`, a
    // device allocation of at least n u32.
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| cuda_err("cuLaunchKernel(transform)", id, e))
}

#[allow(unsafe_code, clippy::too_many_arguments)]
fn launch_verify(
    s: &Arc<CudaStream>,
    f: &CudaFunction,
    buf: u64,
    n: u64,
    seed: u32,
    out: &mut CudaSlice<u64>,
    cfg: LaunchConfig,
    id: &str,
) -> Result<(), GpuError> {
    let mut b = s.launch_builder(f);
    b.arg(&buf).arg(&n).arg(&seed).arg(out);
    // SAFETY: `verify(.u64 buf, .u64 n, .u32 seed, .u64 out)` reads [0, n) of `buf` (a
    // device allocation of at least n u32 on the stream's device) and
    // updates out[0] and out[1]; `out` holds two u64.
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| cuda_err("cuLaunchKernel(verify)", id, e))
}

#[allow(unsafe_code)]
fn launch_fill_f32(
    s: &Arc<CudaStream>,
    f: &CudaFunction,
    buf: u64,
    n: u64,
    value: f32,
    cfg: LaunchConfig,
    id: &str,
) -> Result<(), GpuError> {
    let mut b = s.launch_builder(f);
    b.arg(&buf).arg(&n).arg(&value);
    // SAFETY: `fill_f32(.u64 buf, .u64 n, .f32 value)` writes [0, n) of `buf`, a device
    // allocation of at least n f32.
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| cuda_err("cuLaunchKernel(fill_f32)", id, e))
}

#[allow(unsafe_code, clippy::too_many_arguments)]
fn launch_count_ne(
    s: &Arc<CudaStream>,
    f: &CudaFunction,
    buf: u64,
    n: u64,
    want: f32,
    out: &mut CudaSlice<u64>,
    cfg: LaunchConfig,
    id: &str,
) -> Result<(), GpuError> {
    let mut b = s.launch_builder(f);
    b.arg(&buf).arg(&n).arg(&want).arg(out);
    // SAFETY: `count_ne_f32(.u64 buf, .u64 n, .f32 want, .u64 out)` reads [0, n) of `buf`
    // and adds to out[0]; `out` holds one u64.
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| cuda_err("cuLaunchKernel(count_ne_f32)", id, e))
}

/// Enable direct peer access from `a`'s context to `b`'s memory when the devices support
/// it; true when access is direct.
#[allow(unsafe_code)]
fn enable_peer_access(a: &Loaded, b: &Loaded, id: &str) -> Result<bool, GpuError> {
    use cudarc::driver::sys;
    a.ctx.bind_to_thread().map_err(|e| cuda_err("cuCtxSetCurrent", id, e))?;
    let mut can = 0i32;
    // SAFETY: both device handles come from live contexts; `can` is a valid out-pointer.
    let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.ctx.cu_device(), b.ctx.cu_device()) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(cuda_err("cuDeviceCanAccessPeer", id, DriverError(r)));
    }
    if can == 0 {
        return Ok(false);
    }
    // SAFETY: `a`'s context is current on this thread (bound above) and `b`'s context is a
    // live primary context; flags must be 0.
    let r = unsafe { sys::cuCtxEnablePeerAccess(b.ctx.cu_ctx(), 0) };
    match r {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(true),
        other => Err(cuda_err("cuCtxEnablePeerAccess", id, DriverError(other))),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::reason::Reason;
    use crate::reason::ReasonCode;

    #[test]
    fn expected_values_follow_the_kernel() {
        assert_eq!(expected_element(0, 0), ADD);
        assert_eq!(expected_element(1, 0), MUL.wrapping_add(ADD));
        // Wraps mod 2^32 and uses the low 32 bits of the index.
        assert_eq!(expected_element(1 << 32, 5), expected_element(0, 5));
        assert_ne!(seed_for(0), seed_for(1));
    }

    #[test]
    fn uuid_formats_like_nvml() {
        let b: [u8; 16] = [0xde, 0xad, 0xbe, 0xef, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0xff];
        assert_eq!(format_uuid(&b), "GPU-deadbeef-0001-0203-0405-060708090aff");
        assert_eq!(format_uuid_with("MIG", &b), "MIG-deadbeef-0001-0203-0405-060708090aff");
    }

    /// issue 34 item 14: a CUDA failure in peer-bw carries a peer-bw reason, not SmokeFailed.
    #[test]
    fn peer_bw_cuda_errors_are_not_smoke_failures() {
        // (Not through `cuda_err`: DriverError's Debug asks libcuda for the message.)
        let e = GpuError::Cuda {
            call: "cuMemcpyPeerAsync".into(),
            gpu: "GPU-x".into(),
            message: "CUDA_ERROR_INVALID_VALUE".into(),
        };
        assert_eq!(e.reason(), Reason::SmokeFailed);
        assert_eq!(as_peer(e).reason(), Reason::PeerBandwidthFailed);
        assert_eq!(as_peer(GpuError::NcclMissing("x".into())).reason(), Reason::NcclMissing);
    }

    #[test]
    fn median_of_samples() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn ptx_declares_every_kernel_the_host_launches() {
        for k in ["fill", "transform", "verify", "fill_f32", "count_ne_f32"] {
            assert!(SMOKE_PTX.contains(&format!(".visible .entry {k}(")), "{k}");
        }
        assert!(SMOKE_PTX.contains(".version 7.0"));
    }
}
