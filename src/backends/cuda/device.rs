//! The process-wide CUDA device: library probing (before cudarc touches a library, since
//! it panics where one is missing), the context, and the kernels of `cuda/*.cu` compiled
//! by NVRTC for this device's compute capability, one family (source file) at a time on
//! the first use of one of its kernels. Also the launch helper the kernel families share.

pub use crate::backends::common::{bcast_strides, strides};
use crate::error::Result;
use crate::tensor::DType;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    LaunchConfig, PushKernelArg,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Included before every family's source: the types and helpers they share.
/// The unary op codes, generated from src/graph/elementwise.rs (tests/opcodes.rs).
const OPCODES: &str = include_str!("../../../cuda/opcodes.cuh");
const COMMON: &str = include_str!("../../../cuda/common.cuh");

/// The kernel families: each file of cuda/ is its own NVRTC program and module, compiled
/// on the first use of one of its kernels (a model without attention never waits for
/// flash.cu, the slowest to compile). scripts/precompile_kernels.py lists them too.
const FAMILIES: [(&str, &str); 7] = [
    ("elementwise", include_str!("../../../cuda/elementwise.cu")),
    ("reduce", include_str!("../../../cuda/reduce.cu")),
    ("shape", include_str!("../../../cuda/shape.cu")),
    ("attention", include_str!("../../../cuda/attention.cu")),
    ("flash", include_str!("../../../cuda/flash.cu")),
    ("flash_tf32", include_str!("../../../cuda/flash_tf32.cu")),
    ("optimizer", include_str!("../../../cuda/optimizer.cu")),
];

/// A family's module once compiled and loaded, or why it could not be.
type Loaded = std::result::Result<Arc<CudaModule>, String>;

/// Shared by every CUDA backend instance of the process.
pub struct Device {
    pub ctx: Arc<CudaContext>,
    pub name: String,
    pub cc: (i32, i32),
    /// Per family (FAMILIES order), set by the first thread that needs it; the others
    /// needing the same family wait for it, other families compile concurrently.
    modules: [OnceLock<Loaded>; FAMILIES.len()],
    functions: Mutex<HashMap<String, CudaFunction>>,
    /// The dynamic shared memory each kernel was allowed so far (beyond the default 48 KiB
    /// a kernel must opt in, once).
    smem_allowed: Mutex<HashMap<String, usize>>,
}

/// Why CUDA cannot be used here, in one line; `None` when the libraries load.
fn missing_library() -> Option<&'static str> {
    // Safety: these only try to dlopen the library.
    unsafe {
        if !cudarc::driver::sys::is_culib_present() {
            return Some("the CUDA driver library (libcuda) is not installed on this machine");
        }
        if !cudarc::nvrtc::sys::is_culib_present() {
            return Some("the NVRTC library (libnvrtc) of CUDA 13 is not found");
        }
        if !cudarc::cublaslt::sys::is_culib_present() {
            return Some("the cuBLASLt library (libcublasLt) of CUDA 13 is not found");
        }
    }
    None
}

/// Device 0, set up on first use; an error (never a panic) where there is none.
pub fn device() -> Result<Arc<Device>> {
    device_on(0)
}

/// The device of CUDA ordinal `ordinal` (data-parallel workers use one each), set up on
/// first use and shared by every backend instance on it.
pub fn device_on(ordinal: usize) -> Result<Arc<Device>> {
    type Opened = std::result::Result<Arc<Device>, String>;
    static DEVICES: OnceLock<Mutex<HashMap<usize, Opened>>> = OnceLock::new();
    let mut map = DEVICES
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| crate::err!(Runtime, "CUDA device table poisoned"))?;
    map.entry(ordinal)
        .or_insert_with(|| open(ordinal).map(Arc::new))
        .clone()
        .map_err(|m| crate::err!(Runtime, "CUDA backend unavailable: {m}"))
}

/// How many CUDA devices this machine has (0 where CUDA cannot be used).
pub fn device_count() -> usize {
    if missing_library().is_some() || cudarc::driver::result::init().is_err() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// Whether `--backend cuda` can run here (what tests and `doctor` ask).
pub fn available() -> std::result::Result<(), String> {
    device().map(|_| ()).map_err(|e| e.to_string())
}

fn open(ordinal: usize) -> std::result::Result<Device, String> {
    if let Some(m) = missing_library() {
        return Err(m.into());
    }
    cudarc::driver::result::init().map_err(|e| format!("CUDA driver init failed: {e:?}"))?;
    let n = CudaContext::device_count().map_err(|e| format!("no CUDA device: {e:?}"))?;
    if n < 1 {
        return Err("no CUDA device is present".into());
    }
    if ordinal >= n as usize {
        return Err(format!(
            "CUDA device {ordinal} does not exist (this machine has {n})"
        ));
    }
    let ctx = CudaContext::new(ordinal)
        .map_err(|e| format!("cannot open CUDA device {ordinal}: {e:?}"))?;
    // Each backend instance uses one stream and its buffers never leave it, so cudarc's
    // per-buffer cross-stream events are pure overhead.
    // Safety: no buffer is shared between streams.
    unsafe { ctx.disable_event_tracking() };
    let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
    let cc = ctx
        .compute_capability()
        .map_err(|e| format!("cannot read the compute capability: {e:?}"))?;
    Ok(Device {
        ctx,
        name,
        cc,
        modules: Default::default(),
        functions: Mutex::new(HashMap::new()),
        smem_allowed: Mutex::new(HashMap::new()),
    })
}

/// NVRTC's options for compute capability `cc`.
fn options(cc: (i32, i32)) -> [String; 2] {
    [
        // sm_90a on Hopper: its own instructions (wgmma, cuda/flash.cu) are only there.
        format!(
            "--gpu-architecture=sm_{}{}{}",
            cc.0,
            cc.1,
            if cc == (9, 0) { "a" } else { "" }
        ),
        "--std=c++17".to_string(),
    ]
}

/// The program of family `fam`: opcodes.cuh, common.cuh, then its file.
fn family_source(fam: usize) -> String {
    [OPCODES, COMMON, FAMILIES[fam].1].join("\n")
}

/// The disk-cache key of a program: a hash of its source, options and NVRTC version
/// (`nvrtc M.m`), as scripts/precompile_kernels.py computes it.
fn cache_key(src: &str, opts: &[String], nvrtc: &str) -> u64 {
    fnv1a(&[src.as_bytes(), opts.join(" ").as_bytes(), nvrtc.as_bytes()].concat())
}

/// Family `fam` compiled by NVRTC to machine code for `sm_XY` of this device, cached on
/// disk (see `cache_dir`) as `<family>-<key>.cubin`: a family takes seconds to compile
/// (flash.cu most), every later process loads it in milliseconds.
fn compile(fam: usize, cc: (i32, i32)) -> std::result::Result<cudarc::nvrtc::Ptx, String> {
    let (family, _) = FAMILIES[fam];
    let src = family_source(fam);
    let opts = options(cc);
    let (mut major, mut minor) = (0, 0);
    // Safety: reads two integers.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    let key = cache_key(&src, &opts, &format!("nvrtc {major}.{minor}"));
    let file = cache_dir().map(|d| d.join(format!("{family}-{key:016x}.cubin")));
    if let Some(bin) = file.as_ref().and_then(|f| std::fs::read(f).ok()) {
        return Ok(cudarc::nvrtc::Ptx::from_binary(bin));
    }
    let bin = nvrtc_cubin(family, &src, &opts)?;
    if let Some(f) = &file {
        // Best effort: a cache that cannot be written only costs the next process time.
        // The temporary name is unique per process and thread (workers of one process
        // may compile the same family on different devices at once).
        let tmp = f.with_extension(format!(
            "tmp{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        if f.parent()
            .is_some_and(|d| std::fs::create_dir_all(d).is_ok())
            && std::fs::write(&tmp, &bin).is_ok()
            && std::fs::rename(&tmp, f).is_err()
        {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok(cudarc::nvrtc::Ptx::from_binary(bin))
}

/// The folder of kernels shipped beside the executable, `graphrun-kernels/` (made by
/// `scripts/precompile_kernels.py --ship`).
fn shipped_dir() -> Option<std::path::PathBuf> {
    let exe = std::env::current_exe().ok()?;
    Some(exe.parent()?.join("graphrun-kernels"))
}

/// The file a shipped family has for compute capability `cc`: named by the architecture
/// and a hash of the source and options (not of the NVRTC version: machine code from any
/// NVRTC runs where the driver takes it, and a driver that does not is a fallback to
/// NVRTC, see `Device::function`).
fn shipped_file(fam: usize, cc: (i32, i32)) -> Option<std::path::PathBuf> {
    let opts = options(cc);
    let arch = opts[0].trim_start_matches("--gpu-architecture=");
    let key = cache_key(&family_source(fam), &opts, "shipped");
    Some(shipped_dir()?.join(format!("{}-{arch}-{key:016x}.cubin", FAMILIES[fam].0)))
}

/// The portable form shipped beside the binary: PTX for compute capability 8.0, which the
/// driver compiles for any GPU from 8.0 on that has no machine code there (8.6, 10.0,
/// 12.0, ...). Not for the flash family on 9.0: there graphrun launches the wgmma kernels,
/// which only sm_90a machine code has.
const PTX_ARCH: &str = "compute_80";

/// The options the shipped PTX is made with (`scripts/precompile_kernels.py --ship`).
fn ptx_options() -> [String; 2] {
    [
        format!("--gpu-architecture={PTX_ARCH}"),
        "--std=c++17".to_string(),
    ]
}

/// The shipped PTX of family `fam`, where a GPU of compute capability `cc` may run it.
fn shipped_ptx(fam: usize, cc: (i32, i32)) -> Option<std::path::PathBuf> {
    if cc.0 < 8 || (cc == (9, 0) && FAMILIES[fam].0 == "flash") {
        return None;
    }
    let key = cache_key(&family_source(fam), &ptx_options(), "shipped");
    Some(shipped_dir()?.join(format!("{}-{PTX_ARCH}-{key:016x}.ptx", FAMILIES[fam].0)))
}

/// The names a family defines, from its source: the identifier after each
/// `__global__ void` (past any `__launch_bounds__(...)`). A name made by a macro
/// (`unary_##S`) stands for every name starting with its part before the first `##`.
fn kernel_names(src: &str) -> Vec<(&str, bool)> {
    let mut out = vec![];
    for part in src.split("__global__ void").skip(1) {
        let mut rest = part.trim_start();
        if let Some(r) = rest.strip_prefix("__launch_bounds__") {
            // Skip the balanced parentheses of the bounds.
            let mut depth = 0;
            let end = r
                .char_indices()
                .find(|&(_, c)| {
                    depth += (c == '(') as i32 - (c == ')') as i32;
                    c == ')' && depth == 0
                })
                .map_or(r.len(), |(i, _)| i + 1);
            rest = r[end..].trim_start();
        }
        let ident = rest
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '#'))
            .next()
            .unwrap_or("");
        match ident.split_once("##") {
            Some((prefix, _)) => out.push((prefix, true)),
            None => out.push((ident, false)),
        }
    }
    out
}

/// Which family defines kernel `name` (the longest matching name or prefix of
/// `kernel_names`; the unit tests check no two families' names overlap).
fn family_of(name: &str) -> Option<usize> {
    static TABLE: OnceLock<Vec<(&'static str, bool, usize)>> = OnceLock::new();
    let table = TABLE.get_or_init(|| {
        FAMILIES
            .iter()
            .enumerate()
            .flat_map(|(f, (_, src))| kernel_names(src).into_iter().map(move |(n, p)| (n, p, f)))
            .collect()
    });
    table
        .iter()
        .filter(|&&(n, prefix, _)| {
            if prefix {
                name.starts_with(n)
            } else {
                name == n
            }
        })
        .max_by_key(|(n, _, _)| n.len())
        .map(|&(_, _, f)| f)
}

/// `GRAPHRUN_CUDA_CACHE`, else `$XDG_CACHE_HOME/graphrun`, else `~/.cache/graphrun`.
fn cache_dir() -> Option<std::path::PathBuf> {
    if let Some(d) = std::env::var_os("GRAPHRUN_CUDA_CACHE") {
        return (!d.is_empty()).then(|| d.into());
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(std::path::PathBuf::from(d).join("graphrun"));
    }
    std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache/graphrun"))
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn nvrtc_cubin(family: &str, src: &str, opts: &[String]) -> std::result::Result<Vec<u8>, String> {
    use cudarc::nvrtc::{result, sys};
    let csrc = std::ffi::CString::new(src).map_err(|e| e.to_string())?;
    let name = std::ffi::CString::new(format!("{family}.cu")).map_err(|e| e.to_string())?;
    let prog = result::create_program(&csrc, Some(&name))
        .map_err(|e| format!("NVRTC failed on kernel family '{family}': {e:?}"))?;
    // Safety: `prog` is live until destroyed at the end; sizes come from NVRTC.
    unsafe {
        let out = match result::compile_program(prog, opts) {
            Ok(()) => {
                let mut n = 0usize;
                let mut bin = vec![];
                let r = sys::nvrtcGetCUBINSize(prog, &mut n).result().and_then(|_| {
                    bin = vec![0u8; n];
                    sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut std::ffi::c_char).result()
                });
                r.map(|_| bin)
                    .map_err(|e| format!("NVRTC gave no machine code for '{family}': {e:?}"))
            }
            Err(_) => {
                let log = result::get_program_log(prog).unwrap_or_default();
                let log: Vec<u8> = log
                    .iter()
                    .map(|&c| c as u8)
                    .take_while(|&c| c != 0)
                    .collect();
                Err(format!(
                    "NVRTC failed on kernel family '{family}' (cuda/common.cuh + cuda/{family}.cu):\n{}",
                    String::from_utf8_lossy(&log)
                ))
            }
        };
        let _ = result::destroy_program(prog);
        out
    }
}

impl Device {
    /// A kernel by name (looked up once, then cached), compiling its family first where
    /// no kernel of it was used yet.
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        let functions = || {
            self.functions
                .lock()
                .map_err(|_| crate::err!(Runtime, "CUDA kernel table poisoned"))
        };
        if let Some(k) = functions()?.get(name) {
            return Ok(k.clone());
        }
        // No lock held while a family compiles: kernels of other families go on.
        let fam = family_of(name)
            .ok_or_else(|| crate::err!(Runtime, "CUDA kernel '{name}' is in no file of cuda/"))?;
        let module = self.modules[fam]
            .get_or_init(|| {
                // Machine code shipped beside the binary first, then the shipped PTX (the
                // driver compiles it once and keeps it in its own cache): no NVRTC on the way.
                let shipped = shipped_file(fam, self.cc).and_then(|f| std::fs::read(f).ok());
                if let Some(bin) = shipped {
                    if let Ok(m) = self.ctx.load_module(cudarc::nvrtc::Ptx::from_binary(bin)) {
                        return Ok(m);
                    }
                }
                let ptx = shipped_ptx(fam, self.cc).and_then(|f| std::fs::read_to_string(f).ok());
                if let Some(src) = ptx {
                    if let Ok(m) = self.ctx.load_module(cudarc::nvrtc::Ptx::from_src(src)) {
                        return Ok(m);
                    }
                }
                let bin = compile(fam, self.cc)?;
                self.ctx
                    .load_module(bin)
                    .map_err(|e| format!("cannot load kernel family '{}': {e:?}", FAMILIES[fam].0))
            })
            .clone()
            .map_err(|m| crate::err!(Runtime, "CUDA kernels unavailable: {m}"))?;
        let k = module.load_function(name).map_err(|e| {
            crate::err!(
                Runtime,
                "CUDA kernel '{name}' not found in family '{}': {e:?}",
                FAMILIES[fam].0
            )
        })?;
        functions()?.insert(name.to_string(), k.clone());
        Ok(k)
    }
}

/// What `graphrun doctor` prints about CUDA, one line per fact.
pub fn doctor_lines() -> Vec<String> {
    if let Some(m) = missing_library() {
        return vec![format!("not available: {m}")];
    }
    let mut v = vec![];
    // Safety: the libraries are present (checked above); these read version numbers.
    unsafe {
        let mut d = 0;
        cudarc::driver::sys::cuDriverGetVersion(&mut d);
        v.push(format!("driver: CUDA {}.{}", d / 1000, (d % 1000) / 10));
        let (mut a, mut b) = (0, 0);
        cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b);
        v.push(format!("NVRTC: {a}.{b}"));
        let l = cudarc::cublaslt::sys::cublasLtGetVersion();
        v.push(format!(
            "cuBLASLt: {}.{}.{}",
            l / 10000,
            (l / 100) % 100,
            l % 100
        ));
    }
    match device() {
        Ok(d) => {
            let shipped: Vec<&str> = (0..FAMILIES.len())
                .filter(|&f| shipped_file(f, d.cc).is_some_and(|p| p.is_file()))
                .map(|f| FAMILIES[f].0)
                .collect();
            // Families with no machine code for this GPU that run from the shipped PTX.
            let ptx: Vec<&str> = (0..FAMILIES.len())
                .filter(|f| !shipped.contains(&FAMILIES[*f].0))
                .filter(|&f| shipped_ptx(f, d.cc).is_some_and(|p| p.is_file()))
                .map(|f| FAMILIES[f].0)
                .collect();
            let arch = options(d.cc)[0]
                .trim_start_matches("--gpu-architecture=")
                .to_string();
            let how = match shipped.len() {
                0 => format!("kernels compiled by NVRTC for {arch} on first use (none shipped for it beside the binary)"),
                n if n == FAMILIES.len() => format!("kernels precompiled for {arch}: all {n} families shipped beside the binary"),
                n => format!(
                    "kernels precompiled for {arch}: {n} of {} families shipped beside the binary ({}); NVRTC compiles the others on first use",
                    FAMILIES.len(),
                    shipped.join(", ")
                ),
            };
            v.push(format!(
                "device 0: {} (compute capability {}.{}), {how}",
                d.name, d.cc.0, d.cc.1
            ));
            if !ptx.is_empty() {
                v.push(format!(
                    "shipped {PTX_ARCH} PTX, compiled by the driver on first use: {}",
                    ptx.join(", ")
                ));
            }
            if let Some(dir) = shipped_dir() {
                v.push(format!("shipped kernels: {}", dir.display()));
            }
        }
        Err(e) => v.push(e.to_string()),
    }
    v.push(format!(
        "devices: {} (data-parallel training: --gpus)",
        device_count()
    ));
    v.push(super::nccl::doctor_line());
    v.push(super::cudnn::doctor_line());
    v
}

/// Kernel-name suffix of a dtype (the `M(type, suffix)` lists of cuda/common.cuh): its name.
pub fn suffix(dt: DType) -> &'static str {
    dt.name()
}

/// Suffix of the word type that moves elements of this dtype unchanged.
pub fn word(dt: DType) -> &'static str {
    match dt.size() {
        1 => "w1",
        2 => "w2",
        4 => "w4",
        _ => "w8",
    }
}

/// Rank limit of `Strided` (MAXR in cuda/common.cuh).
pub const MAXR: usize = 8;

/// cuda/common.cuh `Strided`: a row-major walk over `shape` with up to three operands.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Strided {
    rank: i32,
    /// 1 when the walk has fewer than 2^31 elements: kernels index in 32 bits.
    small: i32,
    shape: [i64; MAXR],
    st: [[i64; MAXR]; 3],
    base: [i64; 3],
}
// Safety: plain old data laid out as the C struct.
unsafe impl DeviceRepr for Strided {}

impl Strided {
    /// A walk over `shape` with operand strides `st[k]` (one per dim) and offsets `base`.
    /// Size-1 dims are dropped and adjacent dims that every operand walks contiguously are
    /// merged (the same walk with fewer index divisions in the kernels; a same-shape
    /// elementwise op becomes rank 1).
    pub fn new(shape: &[usize], st: &[&[i64]], base: &[i64]) -> Result<Strided> {
        let mut dims: Vec<(usize, Vec<i64>)> = vec![];
        for (d, &n) in shape.iter().enumerate() {
            if n == 1 {
                continue;
            }
            let sd: Vec<i64> = st.iter().map(|s| s[d]).collect();
            if let Some((pn, ps)) = dims.last_mut() {
                if ps.iter().zip(&sd).all(|(&p, &q)| p == q * n as i64) {
                    *pn *= n;
                    ps.clone_from(&sd);
                    continue;
                }
            }
            dims.push((n, sd));
        }
        if dims.len() > MAXR {
            crate::bail!(
                Runtime,
                "the CUDA backend takes tensors of rank at most {MAXR}, got rank {}",
                shape.len()
            );
        }
        let total = dims.iter().try_fold(1usize, |a, (n, _)| a.checked_mul(*n));
        let mut s = Strided {
            rank: dims.len() as i32,
            small: total.is_some_and(|t| t < 1 << 31) as i32,
            ..Default::default()
        };
        for (d, (n, sd)) in dims.iter().enumerate() {
            s.shape[d] = *n as i64;
            for (k, &v) in sd.iter().enumerate() {
                s.st[k][d] = v;
            }
        }
        for (k, &b) in base.iter().enumerate() {
            s.base[k] = b;
        }
        Ok(s)
    }

    /// Operands broadcast to `out` (numpy rules): stride 0 along repeated dims.
    pub fn broadcast(out: &[usize], ins: &[&[usize]]) -> Result<Strided> {
        let st: Vec<Vec<i64>> = ins.iter().map(|s| bcast_strides(s, out)).collect();
        let refs: Vec<&[i64]> = st.iter().map(|v| &v[..]).collect();
        Strided::new(out, &refs, &[])
    }
}

/// A kernel argument: what a launch passes by value.
pub enum Arg {
    Ptr(u64),
    I64(i64),
    I32(i32),
    U64(u64),
    F32(f32),
    F64(f64),
    Strided(Strided),
    Attn(super::attention::AttnGeom),
    Window(super::shape::WinGeom),
    Sgd(Box<super::optim::SgdTensors>),
}

/// A raw device pointer of a buffer (0 for none: kernels test optional operands for null).
pub fn ptr(b: &CudaSlice<u8>, s: &CudaStream) -> u64 {
    let (p, _sync) = b.device_ptr(s);
    p
}

/// Launches `name` on `stream` with `grid` blocks of `block` threads.
pub fn launch(
    dev: &Device,
    stream: &CudaStream,
    name: &str,
    grid: u32,
    block: u32,
    args: &[Arg],
) -> Result<()> {
    if grid == 0 {
        return Ok(());
    }
    let f = dev.function(name)?;
    let mut b = stream.launch_builder(&f);
    for a in args {
        push_arg(&mut b, a);
    }
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    // Safety: each kernel's argument list is built by its family module to match the
    // signature in cuda/*.cu.
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| crate::err!(Runtime, "CUDA launch of '{name}' failed: {e:?}"))
}

/// Launches `name` on a 3-D grid with `smem` bytes of dynamic shared memory (raising the
/// kernel's limit first where it is over the default 48 KiB).
#[allow(clippy::too_many_arguments)]
pub fn launch_grid(
    dev: &Device,
    stream: &CudaStream,
    name: &str,
    grid: (u32, u32, u32),
    block: u32,
    smem: usize,
    args: &[Arg],
) -> Result<()> {
    if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
        return Ok(());
    }
    let f = dev.function(name)?;
    if smem > 48 << 10 {
        let mut allowed = dev
            .smem_allowed
            .lock()
            .map_err(|_| crate::err!(Runtime, "CUDA kernel table poisoned"))?;
        if allowed.get(name).copied().unwrap_or(0) < smem {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| {
                crate::err!(
                    Runtime,
                    "kernel '{name}' cannot have {smem} bytes of shared memory: {e:?}"
                )
            })?;
            allowed.insert(name.to_string(), smem);
        }
    }
    let mut b = stream.launch_builder(&f);
    for a in args {
        push_arg(&mut b, a);
    }
    let cfg = LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    // Safety: each kernel's argument list is built by its family module to match the
    // signature in cuda/*.cu.
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| crate::err!(Runtime, "CUDA launch of '{name}' failed: {e:?}"))
}

fn push_arg<'a>(b: &mut cudarc::driver::LaunchArgs<'a>, a: &'a Arg) {
    match a {
        Arg::Ptr(v) | Arg::U64(v) => b.arg(v),
        Arg::I64(v) => b.arg(v),
        Arg::I32(v) => b.arg(v),
        Arg::F32(v) => b.arg(v),
        Arg::F64(v) => b.arg(v),
        Arg::Strided(v) => b.arg(v),
        Arg::Attn(v) => b.arg(v),
        Arg::Window(v) => b.arg(v),
        Arg::Sgd(v) => b.arg(&**v),
    };
}

/// Blocks of 256 threads covering `n` elements with grid-stride loops.
pub fn grid_for(n: usize) -> u32 {
    n.div_ceil(256).clamp(0, 1 << 16) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every family defines kernels, and no name (or macro prefix) of one family is a
    /// prefix of another family's: `family_of` can never pick the wrong module.
    #[test]
    fn kernel_names_route_to_one_family() {
        let names: Vec<Vec<(&str, bool)>> = FAMILIES.iter().map(|(_, s)| kernel_names(s)).collect();
        for (f, n) in names.iter().enumerate() {
            assert!(n.len() >= 2, "family {} defines {n:?}", FAMILIES[f].0);
            assert!(n.iter().all(|(k, _)| !k.is_empty()), "{n:?}");
        }
        for (a, na) in names.iter().enumerate() {
            for (b, nb) in names.iter().enumerate().filter(|&(b, _)| b != a) {
                for (x, _) in na {
                    for (y, _) in nb {
                        assert!(
                            !y.starts_with(x),
                            "'{x}' of {} is a prefix of '{y}' of {}",
                            FAMILIES[a].0,
                            FAMILIES[b].0
                        );
                    }
                }
            }
        }
        // Names as the Rust side builds them (suffixes of cuda/common.cuh's FOR_* lists).
        for (name, fam) in [
            ("unary_f32", "elementwise"),
            ("cast_bf16_i64", "elementwise"),
            ("pow_x_f16_i32", "elementwise"),
            ("reduce_part_f64", "reduce"),
            ("labels_i32", "reduce"),
            ("copy_w16", "shape"),
            ("gather_grad_bf16", "shape"),
            ("attn_dkv_f16", "attention"),
            ("fa_fwd_bf16_64m", "flash"),
            ("fs_dq", "flash"),
            ("ft_dkv_3", "flash_tf32"),
            ("ft_fwd_1", "flash_tf32"),
            ("adam_f32", "optimizer"),
            ("accumulate_bf16", "optimizer"),
        ] {
            assert_eq!(family_of(name).map(|f| FAMILIES[f].0), Some(fam), "{name}");
        }
        assert_eq!(family_of("labels_f32"), None);
        assert_eq!(family_of("no_such_kernel"), None);
    }

    /// scripts/precompile_kernels.py names its cubins with the keys computed here (else
    /// a precompiled cache is silently ignored): compared for a fixed NVRTC version.
    #[test]
    fn cache_keys_match_precompile_script() {
        let opts = options((9, 0));
        assert_eq!(opts[0], "--gpu-architecture=sm_90a");
        let ours: String = (0..FAMILIES.len())
            .map(|f| {
                let key = cache_key(&family_source(f), &opts, "nvrtc 13.0");
                format!("{} {key:016x}\n", FAMILIES[f].0)
            })
            .collect();
        println!("{ours}");
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/precompile_kernels.py");
        match std::process::Command::new("python3")
            .args([script, "--keys", "sm_90a", "nvrtc 13.0"])
            .output()
        {
            Ok(o) => {
                assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
                assert_eq!(String::from_utf8_lossy(&o.stdout), ours);
            }
            Err(e) => println!("python3 not runnable here ({e}): script not compared"),
        }
        // The shipped kernels' names (`--ship`): the architecture, and the key over the
        // source and options alone.
        let f = shipped_file(0, (9, 0)).expect("an executable path");
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let key = cache_key(&family_source(0), &opts, "shipped");
        assert_eq!(name, format!("{}-sm_90a-{key:016x}.cubin", FAMILIES[0].0));
        if let Ok(o) = std::process::Command::new("python3")
            .args([script, "--keys", "sm_90a", "shipped"])
            .output()
        {
            let line = format!("{} {key:016x}", FAMILIES[0].0);
            assert!(String::from_utf8_lossy(&o.stdout).contains(&line));
        }
        // The shipped PTX: every family for 8.x and newer GPUs, but not flash on 9.0 (its
        // wgmma kernels are sm_90a machine code only), and nothing before 8.0.
        let key = cache_key(&family_source(0), &ptx_options(), "shipped");
        let f = shipped_ptx(0, (12, 0)).expect("an executable path");
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(name, format!("{}-compute_80-{key:016x}.ptx", FAMILIES[0].0));
        let flash = FAMILIES.iter().position(|f| f.0 == "flash").unwrap();
        assert!(shipped_ptx(flash, (9, 0)).is_none() && shipped_ptx(flash, (8, 6)).is_some());
        assert!(shipped_ptx(0, (7, 5)).is_none());
        if let Ok(o) = std::process::Command::new("python3")
            .args([script, "--keys", "compute_80", "shipped"])
            .output()
        {
            let line = format!("{} {key:016x}", FAMILIES[0].0);
            assert!(String::from_utf8_lossy(&o.stdout).contains(&line));
        }
    }
}
