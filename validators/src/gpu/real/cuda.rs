//! The smoke and peer-bw stages over the CUDA driver API (`cudarc`, `libcuda.so.1` and
//! `libnccl.so.2` loaded at run time).
//!
//! Loading: cudarc's dynamic loading panics when a library or symbol is missing. So the
//! library is first probed with cudarc's own `is_culib_present` (a plain dlopen that returns
//! false), which turns "no driver" / "no NCCL" into typed errors; every CUDA section also
//! runs under `catch_unwind` as the last resort for a driver too old to export a symbol the
//! bindings (cuda-12020) resolve, turning that panic into a `Cuda` error naming the GPU.
//!
//! Kernels: `validators/kernels/smoke.ptx`, hand-written PTX the driver JITs (no toolkit,
//! no NVRTC on the node).

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

/// Expected element `i` after `fill(seed)` then `transform`.
pub fn expected_element(i: u64, seed: u32) -> u32 {
    ((i as u32) ^ seed).wrapping_mul(MUL).wrapping_add(ADD)
}

/// Seed per GPU so that a buffer left over from another GPU's run cannot pass.
pub fn seed_for(index: u32) -> u32 {
    0x9e37_79b9_u32.wrapping_mul(index.wrapping_add(1))
}

/// Format a CUDA UUID (16 bytes) the way NVML prints it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn format_uuid(bytes: &[u8; 16]) -> String {
    let h: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
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

/// Is `libnccl` loadable at all?
#[allow(unsafe_code)]
fn nccl_library_present() -> bool {
    // SAFETY: as for `cuda_library_present`: a plain dlopen probe.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

fn cuda_err(call: &str, gpu: &str, e: DriverError) -> GpuError {
    GpuError::Cuda {
        call: call.into(),
        gpu: gpu.into(),
        message: format!("{e:?}"),
    }
}

/// A context with the smoke module loaded.
struct Loaded {
    ctx: Arc<CudaContext>,
    module: Arc<CudaModule>,
}

/// CUDA state shared by the stages: UUID -> ordinal map and cached primary contexts.
pub(crate) struct CudaBackend {
    ordinals: BTreeMap<String, usize>,
    loaded: Mutex<BTreeMap<usize, Arc<Loaded>>>,
}

impl CudaBackend {
    /// Load the driver, initialise it and map CUDA ordinals to NVML UUIDs (CUDA's default
    /// order is fastest-first, not PCI order, so indexes cannot be assumed to agree).
    pub(crate) fn open() -> Result<Self, GpuError> {
        if !cuda_library_present() {
            return Err(GpuError::DriverNotLoaded(
                "libcuda.so.1 could not be loaded (no NVIDIA driver user-space library on this machine)".into(),
            ));
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

    fn load(&self, gpu: &GpuInfo) -> Result<Arc<Loaded>, GpuError> {
        let ordinal = self.ordinal(gpu)?;
        let mut cache = self.loaded.lock().map_err(|_| GpuError::Cuda {
            call: "context cache".into(),
            gpu: gpu.uuid.clone(),
            message: "lock poisoned".into(),
        })?;
        if let Some(l) = cache.get(&ordinal) {
            return Ok(l.clone());
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("cuDevicePrimaryCtxRetain", &gpu.uuid, e))?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(SMOKE_PTX))
            .map_err(|e| cuda_err("cuModuleLoadData", &gpu.uuid, e))?;
        let l = Arc::new(Loaded { ctx, module });
        cache.insert(ordinal, l.clone());
        Ok(l)
    }

    /// Fill, transform and verify a buffer of `bytes` on one GPU.
    pub(crate) fn smoke(&self, gpu: &GpuInfo, bytes: u64) -> Result<SmokeResult, GpuError> {
        let start = Instant::now();
        guarded("smoke", &gpu.uuid, || self.smoke_inner(gpu, bytes))?;
        Ok(SmokeResult {
            index: gpu.index,
            uuid: gpu.uuid.clone(),
            bytes,
            duration: start.elapsed(),
        })
    }

    fn smoke_inner(&self, gpu: &GpuInfo, bytes: u64) -> Result<(), GpuError> {
        let id = gpu.uuid.as_str();
        let n = (bytes / 4).max(1);
        let len = usize::try_from(n).map_err(|_| GpuError::Cuda {
            call: "cuMemAlloc".into(),
            gpu: id.into(),
            message: format!("{bytes} bytes do not fit this host's address space"),
        })?;
        let l = self.load(gpu)?;
        let stream = l.ctx.default_stream();
        let f = |name: &str| {
            l.module
                .load_function(name)
                .map_err(|e| cuda_err(&format!("cuModuleGetFunction({name})"), id, e))
        };
        let (fill, transform, verify) = (f("fill")?, f("transform")?, f("verify")?);
        let cfg = launch_config(&l.ctx, n, id)?;
        let seed = seed_for(gpu.index);
        // SAFETY (for the allocation): every element is written by `fill` before any read.
        let mut buf = alloc_u32(&stream, len, id)?;
        let mut out = stream
            .clone_htod(&[0u64, u64::MAX])
            .map_err(|e| cuda_err("cuMemcpyHtoD", id, e))?;
        launch_fill(&stream, &fill, &mut buf, n, seed, cfg, id)?;
        launch_transform(&stream, &transform, &mut buf, n, cfg, id)?;
        launch_verify(&stream, &verify, &buf, n, seed, &mut out, cfg, id)?;
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
            let s = start as usize;
            let view = buf.slice(s..s + window as usize);
            let host = stream.clone_dtoh(&view).map_err(|e| cuda_err("cuMemcpyDtoH", id, e))?;
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
        Ok(())
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
        let label = format!("domain {}", domain.id);
        let pairs = guarded("cuMemcpyPeerAsync", &label, || self.copy_matrix(&gpus, opts))?;
        let (allreduce_busbw_gbps, allreduce_skipped) = if gpus.len() < 2 {
            (None, Some("single-GPU domain".to_string()))
        } else if !nccl_library_present() {
            let msg = "libnccl.so.2 could not be loaded".to_string();
            if opts.require_nccl {
                return Err(GpuError::NcclMissing(msg));
            }
            tracing::warn!(domain = domain.id, "{msg}; peer bandwidth from the copy matrix only");
            (None, Some(format!("{msg}; copy matrix only")))
        } else {
            match catch_unwind(AssertUnwindSafe(|| self.allreduce(&gpus, domain.id, opts))) {
                Ok(r) => (Some(r?), None),
                Err(p) => {
                    // A libnccl without a symbol the bindings resolve: treat as missing.
                    let msg = format!("libnccl.so.2 is unusable: {}", panic_text(p));
                    if opts.require_nccl {
                        return Err(GpuError::NcclMissing(msg));
                    }
                    (None, Some(format!("{msg}; copy matrix only")))
                }
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
        let len = usize::try_from(opts.bytes.max(1)).unwrap_or(usize::MAX);
        let loaded: Vec<Arc<Loaded>> = gpus.iter().map(|g| self.load(g)).collect::<Result<_, _>>()?;
        // Direct peer access where the hardware allows it; otherwise the copy is staged
        // through host memory and the figure shows it.
        for (a, la) in loaded.iter().enumerate() {
            for (b, lb) in loaded.iter().enumerate() {
                if a != b {
                    enable_peer_access(la, lb, &gpus[a].uuid)?;
                }
            }
        }
        let bufs: Vec<(Arc<CudaStream>, CudaSlice<u8>)> = loaded
            .iter()
            .zip(gpus)
            .map(|(l, g)| {
                let s = l.ctx.new_stream().map_err(|e| cuda_err("cuStreamCreate", &g.uuid, e))?;
                let b = s
                    .alloc_zeros::<u8>(len)
                    .map_err(|e| cuda_err("cuMemAlloc", &g.uuid, e))?;
                Ok((s, b))
            })
            .collect::<Result<_, GpuError>>()?;
        let mut dst: Vec<CudaSlice<u8>> = loaded
            .iter()
            .zip(gpus)
            .map(|(l, g)| {
                l.ctx
                    .default_stream()
                    .alloc_zeros::<u8>(len)
                    .map_err(|e| cuda_err("cuMemAlloc", &g.uuid, e))
            })
            .collect::<Result<_, _>>()?;
        let mut pairs = Vec::new();
        for a in 0..gpus.len() {
            for b in 0..gpus.len() {
                if a == b {
                    continue;
                }
                let (stream, _) = &bufs[b];
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
                    stream
                        .memcpy_dtod(&bufs[a].1, &mut dst[b])
                        .map_err(|e| cuda_err("cuMemcpyPeerAsync", id, e))?;
                    t1.record(stream).map_err(|e| cuda_err("cuEventRecord", id, e))?;
                    t1.synchronize().map_err(|e| cuda_err("cuEventSynchronize", id, e))?;
                    let ms = t0.elapsed_ms(&t1).map_err(|e| cuda_err("cuEventElapsedTime", id, e))?;
                    if it > 0 {
                        samples.push(crate::gpu::decide::algbw_gbps(len as u64, f64::from(ms) / 1e3));
                    }
                }
                pairs.push(PairBandwidth {
                    src: gpus[a].index,
                    dst: gpus[b].index,
                    gbps: median(&mut samples),
                });
            }
        }
        Ok(pairs)
    }

    fn allreduce(&self, gpus: &[&GpuInfo], domain: u32, opts: &PeerBwOptions) -> Result<f64, GpuError> {
        use cudarc::nccl::{Comm, ReduceOp, group_end, group_start};
        let nerr = |what: &str, e: cudarc::nccl::result::NcclError| GpuError::Nccl {
            domain,
            message: format!("{what}: {e:?}"),
        };
        let n = (opts.bytes / 4).max(1);
        let len = usize::try_from(n).unwrap_or(usize::MAX);
        let loaded: Vec<Arc<Loaded>> = gpus.iter().map(|g| self.load(g)).collect::<Result<_, _>>()?;
        let streams: Vec<Arc<CudaStream>> = loaded
            .iter()
            .zip(gpus)
            .map(|(l, g)| l.ctx.new_stream().map_err(|e| cuda_err("cuStreamCreate", &g.uuid, e)))
            .collect::<Result<_, _>>()?;
        let comms = Comm::from_devices(streams.clone()).map_err(|e| nerr("ncclCommInitAll", e))?;
        let mut send = Vec::new();
        let mut recv = Vec::new();
        for (r, (l, g)) in loaded.iter().zip(gpus).enumerate() {
            let s = &streams[r];
            let fill = l
                .module
                .load_function("fill_f32")
                .map_err(|e| cuda_err("cuModuleGetFunction(fill_f32)", &g.uuid, e))?;
            let mut b = alloc_f32(s, len, &g.uuid)?;
            launch_fill_f32(
                s,
                &fill,
                &mut b,
                n,
                (r + 1) as f32,
                launch_config(&l.ctx, n, &g.uuid)?,
                &g.uuid,
            )?;
            send.push(b);
            recv.push(
                s.alloc_zeros::<f32>(len)
                    .map_err(|e| cuda_err("cuMemAlloc", &g.uuid, e))?,
            );
        }
        let mut times = Vec::new();
        for it in 0..=opts.iterations.max(1) {
            for s in &streams {
                s.synchronize().map_err(|e| cuda_err("cuStreamSynchronize", "-", e))?;
            }
            let t = Instant::now();
            group_start().map_err(|e| nerr("ncclGroupStart", e))?;
            for (r, c) in comms.iter().enumerate() {
                c.all_reduce(&send[r], &mut recv[r], &ReduceOp::Sum)
                    .map_err(|e| nerr("ncclAllReduce", e))?;
            }
            group_end().map_err(|e| nerr("ncclGroupEnd", e))?;
            for (s, g) in streams.iter().zip(gpus) {
                s.synchronize()
                    .map_err(|e| cuda_err("cuStreamSynchronize", &g.uuid, e))?;
            }
            if it > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
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
                &recv[r],
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
        let t = median(&mut times);
        Ok(allreduce_busbw_gbps(opts.bytes, t, ranks as u32))
    }
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
fn alloc_u32(stream: &Arc<CudaStream>, len: usize, id: &str) -> Result<CudaSlice<u32>, GpuError> {
    // SAFETY: the caller fills every element with the `fill` kernel before reading any.
    unsafe { stream.alloc::<u32>(len) }.map_err(|e| cuda_err("cuMemAlloc", id, e))
}

#[allow(unsafe_code)]
fn alloc_f32(stream: &Arc<CudaStream>, len: usize, id: &str) -> Result<CudaSlice<f32>, GpuError> {
    // SAFETY: the caller fills every element with `fill_f32` before reading any.
    unsafe { stream.alloc::<f32>(len) }.map_err(|e| cuda_err("cuMemAlloc", id, e))
}

#[allow(unsafe_code)]
fn launch_fill(
    s: &Arc<CudaStream>,
    f: &CudaFunction,
    buf: &mut CudaSlice<u32>,
    n: u64,
    seed: u32,
    cfg: LaunchConfig,
    id: &str,
) -> Result<(), GpuError> {
    let mut b = s.launch_builder(f);
    b.arg(buf).arg(&n).arg(&seed);
    // SAFETY: `fill(.u64 buf, .u64 n, .u32 seed)` in smoke.ptx takes exactly these argument
    // types in this order and writes only elements [0, n) of `buf`, whose length is n.
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| cuda_err("cuLaunchKernel(fill)", id, e))
}

#[allow(unsafe_code)]
fn launch_transform(
    s: &Arc<CudaStream>,
    f: &CudaFunction,
    buf: &mut CudaSlice<u32>,
    n: u64,
    cfg: LaunchConfig,
    id: &str,
) -> Result<(), GpuError> {
    let mut b = s.launch_builder(f);
    b.arg(buf).arg(&n);
    // SAFETY: `transform(.u64 buf, .u64 n)` reads and writes elements [0, n) of `buf` (length n).
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| cuda_err("cuLaunchKernel(transform)", id, e))
}

#[allow(unsafe_code, clippy::too_many_arguments)]
fn launch_verify(
    s: &Arc<CudaStream>,
    f: &CudaFunction,
    buf: &CudaSlice<u32>,
    n: u64,
    seed: u32,
    out: &mut CudaSlice<u64>,
    cfg: LaunchConfig,
    id: &str,
) -> Result<(), GpuError> {
    let mut b = s.launch_builder(f);
    b.arg(buf).arg(&n).arg(&seed).arg(out);
    // SAFETY: `verify(.u64 buf, .u64 n, .u32 seed, .u64 out)` reads [0, n) of `buf` and
    // updates out[0] and out[1]; `out` holds two u64.
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| cuda_err("cuLaunchKernel(verify)", id, e))
}

#[allow(unsafe_code)]
fn launch_fill_f32(
    s: &Arc<CudaStream>,
    f: &CudaFunction,
    buf: &mut CudaSlice<f32>,
    n: u64,
    value: f32,
    cfg: LaunchConfig,
    id: &str,
) -> Result<(), GpuError> {
    let mut b = s.launch_builder(f);
    b.arg(buf).arg(&n).arg(&value);
    // SAFETY: `fill_f32(.u64 buf, .u64 n, .f32 value)` writes [0, n) of `buf` (length n).
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| cuda_err("cuLaunchKernel(fill_f32)", id, e))
}

#[allow(unsafe_code, clippy::too_many_arguments)]
fn launch_count_ne(
    s: &Arc<CudaStream>,
    f: &CudaFunction,
    buf: &CudaSlice<f32>,
    n: u64,
    want: f32,
    out: &mut CudaSlice<u64>,
    cfg: LaunchConfig,
    id: &str,
) -> Result<(), GpuError> {
    let mut b = s.launch_builder(f);
    b.arg(buf).arg(&n).arg(&want).arg(out);
    // SAFETY: `count_ne_f32(.u64 buf, .u64 n, .f32 want, .u64 out)` reads [0, n) of `buf`
    // and adds to out[0]; `out` holds one u64.
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| cuda_err("cuLaunchKernel(count_ne_f32)", id, e))
}

/// Enable direct peer access from `a`'s context to `b`'s memory when the devices support it.
#[allow(unsafe_code)]
fn enable_peer_access(a: &Loaded, b: &Loaded, id: &str) -> Result<(), GpuError> {
    use cudarc::driver::sys;
    a.ctx.bind_to_thread().map_err(|e| cuda_err("cuCtxSetCurrent", id, e))?;
    let mut can = 0i32;
    // SAFETY: both device handles come from live contexts; `can` is a valid out-pointer.
    let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.ctx.cu_device(), b.ctx.cu_device()) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(cuda_err("cuDeviceCanAccessPeer", id, DriverError(r)));
    }
    if can == 0 {
        return Ok(());
    }
    // SAFETY: `a`'s context is current on this thread (bound above) and `b`'s context is a
    // live primary context; flags must be 0.
    let r = unsafe { sys::cuCtxEnablePeerAccess(b.ctx.cu_ctx(), 0) };
    match r {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        other => Err(cuda_err("cuCtxEnablePeerAccess", id, DriverError(other))),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

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
