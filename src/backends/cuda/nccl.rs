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
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::U8 => 1,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::F32 => 4,
            DataType::F64 => 8,
        }
    }

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

/// ncclUniqueId: what the first process of a multi-process run makes and hands to the
/// others (exec/launch.rs) so that their communicators find each other.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    internal: [c_char; 128],
}

/// ncclRedOp_t ncclAvg: the mean over ranks (NCCL ≥ 2.10).
const AVG: c_int = 4;

struct Fns {
    get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    comm_init_all: unsafe extern "C" fn(*mut Raw, c_int, *const c_int) -> c_int,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    comm_init_rank: unsafe extern "C" fn(*mut Raw, c_int, UniqueId, c_int) -> c_int,
    comm_destroy: unsafe extern "C" fn(Raw) -> c_int,
    comm_abort: unsafe extern "C" fn(Raw) -> c_int,
    async_error: unsafe extern "C" fn(Raw, *mut c_int) -> c_int,
    all_reduce:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Raw, Raw) -> c_int,
    broadcast:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Raw, Raw) -> c_int,
    reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        c_int,
        Raw,
        Raw,
    ) -> c_int,
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
            get_unique_id: sym!("ncclGetUniqueId"),
            comm_init_rank: sym!("ncclCommInitRank"),
            comm_destroy: sym!("ncclCommDestroy"),
            comm_abort: sym!("ncclCommAbort"),
            async_error: sym!("ncclCommGetAsyncError"),
            all_reduce: sym!("ncclAllReduce"),
            broadcast: sym!("ncclBroadcast"),
            reduce: sym!("ncclReduce"),
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

    /// A new id for a communicator spanning processes (`init_ranks`), as bytes.
    pub fn unique_id(&self) -> Result<Vec<u8>> {
        let mut id = UniqueId { internal: [0; 128] };
        // Safety: writes the 128-byte id.
        let r = unsafe { (self.fns.get_unique_id)(&mut id) };
        self.check("ncclGetUniqueId", r)?;
        Ok(id.internal.iter().map(|&c| c as u8).collect())
    }

    /// This process's communicators of a run of `world` ranks spread over processes:
    /// rank `r` on CUDA device `d` for each `(r, d)` of `mine`, all made with the id
    /// from `unique_id` (the same bytes in every process). Blocks until every rank of
    /// every process has joined.
    pub fn init_ranks(
        &'static self,
        id: &[u8],
        world: usize,
        mine: &[(usize, usize)],
    ) -> Result<Vec<std::sync::Arc<Comm>>> {
        let Ok(bytes) = <[u8; 128]>::try_from(id) else {
            crate::bail!(Runtime, "an NCCL id is 128 bytes, got {}", id.len());
        };
        let id = UniqueId {
            internal: bytes.map(|b| b as c_char),
        };
        let mut raw: Vec<Raw> = vec![std::ptr::null_mut(); mine.len()];
        let f = &self.fns;
        // Safety: each call gets room for its communicator, on its device's context
        // (made current first); the group brackets are balanced.
        unsafe {
            self.check("group start", (f.group_start)())?;
            let mut r = 0;
            for (k, &(rank, dev)) in mine.iter().enumerate() {
                let d = super::device::device_on(dev);
                match d.map(|d| d.ctx.bind_to_thread()) {
                    Ok(Ok(())) if r == 0 => {
                        r = (f.comm_init_rank)(&mut raw[k], world as c_int, id, rank as c_int)
                    }
                    _ if r == 0 => r = 1,
                    _ => {}
                }
            }
            let end = (f.group_end)();
            self.check("communicator set-up (ncclCommInitRank)", r)?;
            self.check("communicator set-up (group end)", end)?;
        }
        Ok(raw
            .into_iter()
            .zip(mine)
            .map(|(raw, &(rank, _))| {
                std::sync::Arc::new(Comm {
                    nccl: self,
                    raw,
                    rank,
                    ranks: world,
                    aborted: AtomicBool::new(false),
                })
            })
            .collect())
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

/// The elements of an `n`-element tensor whose optimizer step rank `rank` of `ranks`
/// owns under the sharded optimizer: equal blocks of a multiple of 64 elements (whole
/// cache lines of any dtype), the last ranks' shorter or empty.
pub fn shard(n: usize, ranks: usize, rank: usize) -> std::ops::Range<usize> {
    let per = n.div_ceil(ranks.max(1)).next_multiple_of(64);
    (rank * per).min(n)..((rank + 1) * per).min(n)
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

    /// The sharded optimizer's gradient step: each buffer (address, element count,
    /// type) averaged over the ranks into its owners' shards (`shard`), each rank's
    /// shard arriving on that rank only (a reduce-scatter without padding: one
    /// ncclReduce per shard, as one group), on `stream`.
    pub fn reduce_to_shards(
        &self,
        bufs: &[(u64, usize, DataType)],
        stream: &CudaStream,
    ) -> Result<()> {
        self.grouped(
            "gradient reduce-scatter",
            bufs,
            stream,
            |p, n, dt, root, s| {
                let f = &self.nccl.fns;
                // Safety: as in all_reduce_avg; in place (the root's shard is its own).
                unsafe {
                    (f.reduce)(
                        p as *const c_void,
                        p as *mut c_void,
                        n,
                        dt as c_int,
                        AVG,
                        root as c_int,
                        self.raw,
                        s,
                    )
                }
            },
        )
    }

    /// After a sharded optimizer step: every rank's shard of each buffer copied to every
    /// rank (an all-gather in place: one ncclBroadcast per shard, as one group).
    pub fn gather_shards(
        &self,
        bufs: &[(u64, usize, DataType)],
        stream: &CudaStream,
    ) -> Result<()> {
        self.grouped("parameter all-gather", bufs, stream, |p, n, dt, root, s| {
            // Safety: as in all_reduce_avg.
            unsafe {
                (self.nccl.fns.broadcast)(
                    p as *const c_void,
                    p as *mut c_void,
                    n,
                    dt as c_int,
                    root as c_int,
                    self.raw,
                    s,
                )
            }
        })
    }

    /// One call of `op(address, count, type, root, stream)` per non-empty shard of each
    /// buffer, rank `root` owning it, as one NCCL group.
    fn grouped(
        &self,
        what: &str,
        bufs: &[(u64, usize, DataType)],
        stream: &CudaStream,
        op: impl Fn(u64, usize, DataType, usize, Raw) -> c_int,
    ) -> Result<()> {
        let stream = stream.cu_stream() as Raw;
        self.live()?;
        let f = &self.nccl.fns;
        // Safety: the group brackets are balanced.
        unsafe {
            self.nccl.check("group start", (f.group_start)())?;
            let mut r = 0;
            for &(p, n, dt) in bufs {
                for root in 0..self.ranks {
                    let sh = shard(n, self.ranks, root);
                    if !sh.is_empty() && r == 0 {
                        r = op(
                            p + (sh.start * dt.size()) as u64,
                            sh.len(),
                            dt,
                            root,
                            stream,
                        );
                    }
                }
            }
            let end = (f.group_end)();
            self.nccl.check(what, r)?;
            self.nccl.check(&format!("{what} (group end)"), end)
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
