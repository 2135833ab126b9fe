//! NCCL, the collectives of data-parallel training (exec/parallel.rs), through the few
//! functions graphrun calls, loaded at run time like the rest of CUDA.
//!
//! Why not cudarc's `nccl` feature: its loader tries `libnccl.so`, `libnccl.so.13`,
//! `.12`, … but never NCCL's real soname `libnccl.so.2`, and the usual installation, the
//! `nvidia-nccl` pip wheel that PyTorch depends on, ships only `libnccl.so.2` (no dev
//! symlink). So the library is found here: `GRAPHRUN_NCCL` (a file) first, then the
//! loader's search path under both names, then the wheel's folder in the Python
//! installations of the usual prefixes.

use crate::error::Result;
use cudarc::driver::CudaStream;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

type Raw = *mut c_void;

/// ncclDataType_t
#[derive(Clone, Copy, Debug)]
pub enum DataType {
    /// ncclFloat16.
    F16 = 6,
    /// ncclFloat32.
    F32 = 7,
    /// ncclFloat64.
    F64 = 8,
    /// ncclBfloat16.
    Bf16 = 9,
    /// ncclUint8 (bytes, for copies).
    U8 = 1,
}

impl DataType {
    /// NCCL's type for the floating dtype `dt` (None for the others).
    pub fn of(dt: crate::tensor::DType) -> Option<DataType> {
        use crate::tensor::DType::*;
        Some(match dt {
            F16 => DataType::F16,
            F32 => DataType::F32,
            F64 => DataType::F64,
            BF16 => DataType::Bf16,
            _ => return None,
        })
    }
}

/// ncclRedOp_t ncclAvg: the mean over ranks (NCCL ≥ 2.10).
const AVG: c_int = 4;

struct Fns {
    get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    comm_init_all: unsafe extern "C" fn(*mut Raw, c_int, *const c_int) -> c_int,
    comm_destroy: unsafe extern "C" fn(Raw) -> c_int,
    comm_abort: unsafe extern "C" fn(Raw) -> c_int,
    async_error: unsafe extern "C" fn(Raw, *mut c_int) -> c_int,
    all_reduce:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Raw, Raw) -> c_int,
    broadcast:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Raw, Raw) -> c_int,
    group_start: unsafe extern "C" fn() -> c_int,
    group_end: unsafe extern "C" fn() -> c_int,
}

/// The loaded library.
pub struct Nccl {
    fns: Fns,
    /// Where it was found, and its version (e.g. 22704 for 2.27.4).
    pub path: String,
    /// The version code, major·10000 + minor·100 + patch.
    pub version: i32,
    // Keeps the functions above valid.
    _lib: libloading::Library,
}

/// The files to try for a CUDA library, in order: the file named by the environment
/// variable `env`, then each of `sonames` through the dynamic loader's own search
/// (LD_LIBRARY_PATH, ld.so.cache), then `<site-packages>/nvidia/<wheel_dir>/lib/<first
/// soname>` in the Python installations of the usual prefixes (system, conda, virtualenv,
/// `pip install --user`, pyenv), newest Python first: where the pip wheels that PyTorch
/// depends on put them (nvidia-nccl-cu13, nvidia-cudnn-cu13, ...). Shared with cudnn.rs.
pub(super) fn library_candidates(env: &str, sonames: &[&str], wheel_dir: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = vec![];
    if let Ok(p) = std::env::var(env) {
        v.push(p.into());
    }
    v.extend(sonames.iter().map(PathBuf::from));
    let home = std::env::var("HOME").ok().map(PathBuf::from);
    let mut prefixes: Vec<PathBuf> = ["/usr/local/lib", "/usr/lib", "/opt/conda/lib"]
        .iter()
        .map(PathBuf::from)
        .collect();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Ok(p) = std::env::var(var) {
            prefixes.push(PathBuf::from(p).join("lib"));
        }
    }
    if let Some(h) = &home {
        prefixes.push(h.join(".local/lib"));
    }
    // pyenv: every installed version's lib folder.
    let pyenv_roots = [
        std::env::var("PYENV_ROOT").ok().map(PathBuf::from),
        home.map(|h| h.join(".pyenv")),
    ];
    for root in pyenv_roots.into_iter().flatten() {
        let Ok(dir) = std::fs::read_dir(root.join("versions")) else {
            continue;
        };
        let mut versions: Vec<PathBuf> = dir.flatten().map(|e| e.path().join("lib")).collect();
        versions.sort();
        for lib in versions.into_iter().rev() {
            if !prefixes.contains(&lib) {
                prefixes.push(lib);
            }
        }
    }
    let file = sonames.first().copied().unwrap_or_default();
    for pre in prefixes {
        let Ok(dir) = std::fs::read_dir(&pre) else {
            continue;
        };
        let mut pys: Vec<PathBuf> = dir
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("python3"))
            })
            .collect();
        pys.sort();
        for py in pys.iter().rev() {
            for site in ["site-packages", "dist-packages"] {
                v.push(
                    py.join(site)
                        .join("nvidia")
                        .join(wheel_dir)
                        .join("lib")
                        .join(file),
                );
            }
        }
    }
    v
}

/// Candidate files, in order.
fn candidates() -> Vec<PathBuf> {
    library_candidates("GRAPHRUN_NCCL", &["libnccl.so.2", "libnccl.so"], "nccl")
}

fn open() -> std::result::Result<Nccl, String> {
    let mut tried = vec![];
    for c in candidates() {
        let bare = c.components().count() == 1;
        if !bare && !c.exists() {
            continue;
        }
        // Safety: loading NCCL runs its (trusted) initialisers only.
        match unsafe { libloading::Library::new(&c) } {
            Ok(lib) => return load(lib, c.display().to_string()),
            Err(_) => tried.push(c.display().to_string()),
        }
    }
    Err(format!(
        "the NCCL library (libnccl.so.2) is not found (tried {}); install it (e.g. pip \
         install nvidia-nccl-cu13) or point GRAPHRUN_NCCL at the file",
        tried.join(", ")
    ))
}

fn load(lib: libloading::Library, path: String) -> std::result::Result<Nccl, String> {
    // Safety: the symbols are NCCL's C API with these signatures (nccl.h, NCCL 2.x).
    unsafe {
        macro_rules! sym {
            ($name:literal) => {
                *lib.get($name.as_bytes())
                    .map_err(|e| format!("{path} lacks {}: {e}", $name))?
            };
        }
        let fns = Fns {
            get_version: sym!("ncclGetVersion"),
            error_string: sym!("ncclGetErrorString"),
            comm_init_all: sym!("ncclCommInitAll"),
            comm_destroy: sym!("ncclCommDestroy"),
            comm_abort: sym!("ncclCommAbort"),
            async_error: sym!("ncclCommGetAsyncError"),
            all_reduce: sym!("ncclAllReduce"),
            broadcast: sym!("ncclBroadcast"),
            group_start: sym!("ncclGroupStart"),
            group_end: sym!("ncclGroupEnd"),
        };
        let mut version = 0;
        (fns.get_version)(&mut version);
        if version < 21000 {
            return Err(format!(
                "{path} is NCCL {version}; graphrun needs NCCL 2.10 or newer (ncclAvg)"
            ));
        }
        Ok(Nccl {
            fns,
            path,
            version,
            _lib: lib,
        })
    }
}

/// The library, loaded on first use; an error (never a panic) where there is none.
pub fn nccl() -> Result<&'static Nccl> {
    static LIB: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
    LIB.get_or_init(open)
        .as_ref()
        .map_err(|m| crate::err!(Runtime, "{m}"))
}

/// The `doctor` line.
pub fn doctor_line() -> String {
    match nccl() {
        Ok(n) => format!(
            "NCCL {}.{}.{} ({})",
            n.version / 10000,
            n.version / 100 % 100,
            n.version % 100,
            n.path
        ),
        Err(e) => format!("NCCL: unavailable ({e})"),
    }
}

impl Nccl {
    fn check(&self, what: &str, r: c_int) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        // Safety: returns a static string for any code.
        let msg = unsafe { CStr::from_ptr((self.fns.error_string)(r)) }.to_string_lossy();
        crate::bail!(Runtime, "NCCL {what} failed: {msg} (code {r})")
    }

    /// One communicator per device of `devices` (CUDA ordinals), rank i on `devices[i]`,
    /// made together in this process.
    pub fn init_all(&'static self, devices: &[usize]) -> Result<Vec<std::sync::Arc<Comm>>> {
        let devs: Vec<c_int> = devices.iter().map(|&d| d as c_int).collect();
        let mut raw: Vec<Raw> = vec![std::ptr::null_mut(); devs.len()];
        // Safety: `raw` has room for one communicator per device.
        let r = unsafe {
            (self.fns.comm_init_all)(raw.as_mut_ptr(), devs.len() as c_int, devs.as_ptr())
        };
        self.check("communicator set-up (ncclCommInitAll)", r)?;
        Ok(raw
            .into_iter()
            .enumerate()
            .map(|(rank, raw)| {
                std::sync::Arc::new(Comm {
                    nccl: self,
                    raw,
                    rank,
                    ranks: devs.len(),
                    aborted: AtomicBool::new(false),
                })
            })
            .collect())
    }
}

/// One rank's communicator. Collectives on it are issued by its worker thread alone;
/// `abort` may come from any thread (to free workers blocked in a collective whose peer
/// failed).
pub struct Comm {
    nccl: &'static Nccl,
    raw: Raw,
    /// This communicator's rank, from 0.
    pub rank: usize,
    /// The number of ranks.
    pub ranks: usize,
    aborted: AtomicBool,
}

// Safety: an ncclComm_t may be used from any thread (one at a time for collectives, which
// the owner ensures; ncclCommAbort is meant to be called concurrently).
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NCCL rank {} of {}", self.rank, self.ranks)
    }
}

impl Comm {
    fn live(&self) -> Result<()> {
        if self.aborted.load(Ordering::SeqCst) {
            crate::bail!(
                Runtime,
                "NCCL communicator was aborted (another worker failed)"
            );
        }
        Ok(())
    }

    /// Averages each buffer (device address, element count, type) in place over the
    /// ranks, as one group, on `stream` (a CUstream).
    pub fn all_reduce_avg(
        &self,
        bufs: &[(u64, usize, DataType)],
        stream: &CudaStream,
    ) -> Result<()> {
        let stream = stream.cu_stream() as Raw;
        self.live()?;
        let f = &self.nccl.fns;
        // Safety: each address is a live device buffer of at least `count` elements of
        // its type on this communicator's device; the group brackets are balanced.
        unsafe {
            self.nccl.check("group start", (f.group_start)())?;
            let mut r = 0;
            for &(p, n, dt) in bufs {
                if n > 0 && r == 0 {
                    r = (f.all_reduce)(
                        p as *const c_void,
                        p as *mut c_void,
                        n,
                        dt as c_int,
                        AVG,
                        self.raw,
                        stream,
                    );
                }
            }
            let end = (f.group_end)();
            self.nccl.check("gradient all-reduce", r)?;
            self.nccl.check("gradient all-reduce (group end)", end)
        }
    }

    /// Copies rank `root`'s buffer into every rank's, on `stream`.
    pub fn broadcast(
        &self,
        p: u64,
        n: usize,
        dt: DataType,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        let stream = stream.cu_stream() as Raw;
        self.live()?;
        if n == 0 {
            return Ok(());
        }
        // Safety: as in all_reduce_avg.
        let r = unsafe {
            (self.nccl.fns.broadcast)(
                p as *const c_void,
                p as *mut c_void,
                n,
                dt as c_int,
                root as c_int,
                self.raw,
                stream,
            )
        };
        self.nccl.check("parameter broadcast", r)
    }

    /// An error a collective met after it was issued (a peer that went away).
    pub fn async_error(&self) -> Result<()> {
        self.live()?;
        let mut r = 0;
        // Safety: reads the communicator's state.
        let q = unsafe { (self.nccl.fns.async_error)(self.raw, &mut r) };
        self.nccl.check("status query", q)?;
        self.nccl.check("collective", r)
    }

    /// Stops this communicator's collectives, so that a worker blocked in one returns.
    pub fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // Safety: the communicator is live (not aborted before) and is never used again.
            unsafe { (self.nccl.fns.comm_abort)(self.raw) };
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if !self.aborted.load(Ordering::SeqCst) {
            // Safety: the last owner; no collective is in flight (workers synchronise
            // their streams before they drop their handles).
            unsafe { (self.nccl.fns.comm_destroy)(self.raw) };
        }
    }
}
