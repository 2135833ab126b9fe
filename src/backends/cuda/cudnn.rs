//! Convolutions through cuDNN 9, loaded at run time; where it is missing, convolutions
//! run as im2col + cuBLASLt (the caller's fallback).
//!
//! Why the legacy API (cudnnConvolutionForward & co., deprecated in 9 but supported): a
//! convolution is one call on plain descriptors, with cuDNN's own algorithm search
//! (`Find…AlgorithmEx`, or the `_v7` heuristic while a CUDA graph is being recorded);
//! the graph API would need an engine-config search and an execution-plan cache to say
//! the same thing.
//!
//! Why loaded at run time (libloading, as NCCL in nccl.rs): graphrun builds without a
//! toolkit, and cuDNN is most often the `nvidia-cudnn-cu13` pip wheel that PyTorch
//! depends on, which the loader's search path does not see. `libcudnn.so.9` is a small
//! shim that exports the whole API and loads its sub-libraries (ops, cnn, engines) from
//! its own folder on first use.
//!
//! Layouts: graphrun's tensors are ONNX's contiguous NCHW (NCDHW), which cuDNN takes as
//! they are; a shape may also be described channels-last (`ConvShape::nhwc`), for the
//! tensor-core kernels that want NHWC, on copies the caller transposes (conv.rs).

use crate::error::Result;
use crate::tensor::DType;
use cudarc::driver::CudaStream;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, Mutex, OnceLock};

type Raw = *mut c_void;

/// The three convolutions cuDNN computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Which {
    /// Y = conv(X, W).
    Forward,
    /// dX from dY and W (also a transposed convolution's forward).
    Data,
    /// dW from X and dY.
    Filter,
}

/// One convolution's geometry, NCHW (NCDHW) contiguous tensors; 1-D convolutions are given
/// with one spatial axis and run as 2-D with a leading spatial axis of 1.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ConvShape {
    /// The element type: F16, BF16, F32 or F64.
    pub dt: DType,
    /// Batch.
    pub n: usize,
    /// Input channels.
    pub c: usize,
    /// Output channels.
    pub m: usize,
    /// Groups (c and m are multiples of it).
    pub group: usize,
    /// X's spatial dims (1 to 3 of them).
    pub image: Vec<usize>,
    /// W is [m, c/group, *kernel].
    pub kernel: Vec<usize>,
    /// Y is [n, m, *out].
    pub out: Vec<usize>,
    /// Symmetric padding per spatial axis.
    pub pads: Vec<usize>,
    /// Strides per spatial axis.
    pub strides: Vec<usize>,
    /// Dilations per spatial axis.
    pub dilations: Vec<usize>,
    /// X, W and Y are stored channels-last: `[n, *image, c]`, `[m, *kernel, c/group]` and
    /// `[n, *out, m]` (the dims above keep their meaning).
    pub nhwc: bool,
}

impl std::fmt::Display for ConvShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}{} convolution of X {:?} by W {:?} into Y {:?} (pads {:?}, strides {:?}, \
             dilations {:?}, group {})",
            self.dt.name(),
            if self.nhwc { " channels-last" } else { "" },
            [vec![self.n, self.c], self.image.clone()].concat(),
            [
                vec![self.m, self.c / self.group.max(1)],
                self.kernel.clone()
            ]
            .concat(),
            [vec![self.n, self.m], self.out.clone()].concat(),
            self.pads,
            self.strides,
            self.dilations,
            self.group
        )
    }
}

// cuDNN 9's enum values (cudnn_graph.h, cudnn_ops.h).
const DATA_FLOAT: c_int = 0;
const DATA_DOUBLE: c_int = 1;
const DATA_HALF: c_int = 2;
const DATA_BFLOAT16: c_int = 9;
const TENSOR_NCHW: c_int = 0;
const TENSOR_NHWC: c_int = 1;
const CROSS_CORRELATION: c_int = 1;
const DEFAULT_MATH: c_int = 0;
const TENSOR_OP_MATH: c_int = 1;
const TENSOR_OP_MATH_ALLOW_CONVERSION: c_int = 2;
/// cuDNN 9 status codes: from NOT_SUPPORTED (3000, and its 3xxx sub-codes) up to
/// EXECUTION_FAILED (5000): the algorithm declined or failed to run the call.
const NOT_SUPPORTED: c_int = 3000;
const EXECUTION_FAILED: c_int = 5000;
const FMA_MATH: c_int = 3;
/// Algorithm counts per `Which` (CUDNN_CONVOLUTION_{FWD,BWD_DATA,BWD_FILTER}_ALGO_COUNT).
const ALGO_COUNT: [c_int; 3] = [8, 6, 7];
/// The most workspace an algorithm may take: the search's buffer comes from the backend's
/// scratch pool, which keeps its largest buffer for the session.
const WORKSPACE_CAP: usize = 512 << 20;

/// cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t: one layout for the three.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Perf {
    algo: c_int,
    status: c_int,
    time: f32,
    memory: usize,
    determinism: c_int,
    math: c_int,
    reserved: [c_int; 3],
}

// The three convolutions' functions share their C signatures, with the operands'
// descriptors and pointers in each one's own order (`Plan::operands`): so they are kept
// per `Which`.
/// cudnnConvolution{Forward,BackwardData,BackwardFilter}.
type Run = unsafe extern "C" fn(
    Raw,           // handle
    *const c_void, // alpha
    Raw,           // first operand's descriptor
    *const c_void, // first operand
    Raw,           // second operand's descriptor
    *const c_void, // second operand
    Raw,           // convolution descriptor
    c_int,         // algorithm
    *mut c_void,   // workspace
    usize,         // workspace bytes
    *const c_void, // beta
    Raw,           // result's descriptor
    *mut c_void,   // result
) -> c_int;
/// cudnnFind…AlgorithmEx.
type Find = unsafe extern "C" fn(
    Raw,           // handle
    Raw,           // first operand's descriptor
    *const c_void, // first operand
    Raw,           // second operand's descriptor
    *const c_void, // second operand
    Raw,           // convolution descriptor
    Raw,           // result's descriptor
    *mut c_void,   // result
    c_int,         // requested count
    *mut c_int,    // returned count
    *mut Perf,     // results, fastest first
    *mut c_void,   // workspace
    usize,         // workspace bytes
) -> c_int;
/// cudnnGet…Algorithm_v7: (handle, first, second, conv, result, requested, returned, perf).
type Heuristic =
    unsafe extern "C" fn(Raw, Raw, Raw, Raw, Raw, c_int, *mut c_int, *mut Perf) -> c_int;
/// cudnnGet…WorkspaceSize: (handle, first, second, conv, result, algo, bytes).
type WorkspaceSize = unsafe extern "C" fn(Raw, Raw, Raw, Raw, Raw, c_int, *mut usize) -> c_int;

struct Fns {
    get_version: unsafe extern "C" fn() -> usize,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    create: unsafe extern "C" fn(*mut Raw) -> c_int,
    destroy: unsafe extern "C" fn(Raw) -> c_int,
    set_stream: unsafe extern "C" fn(Raw, Raw) -> c_int,
    create_tensor: unsafe extern "C" fn(*mut Raw) -> c_int,
    set_tensor: unsafe extern "C" fn(Raw, c_int, c_int, *const c_int, *const c_int) -> c_int,
    destroy_tensor: unsafe extern "C" fn(Raw) -> c_int,
    create_filter: unsafe extern "C" fn(*mut Raw) -> c_int,
    set_filter: unsafe extern "C" fn(Raw, c_int, c_int, c_int, *const c_int) -> c_int,
    destroy_filter: unsafe extern "C" fn(Raw) -> c_int,
    create_conv: unsafe extern "C" fn(*mut Raw) -> c_int,
    set_conv: unsafe extern "C" fn(
        Raw,
        c_int,
        *const c_int,
        *const c_int,
        *const c_int,
        c_int,
        c_int,
    ) -> c_int,
    set_group: unsafe extern "C" fn(Raw, c_int) -> c_int,
    set_math: unsafe extern "C" fn(Raw, c_int) -> c_int,
    destroy_conv: unsafe extern "C" fn(Raw) -> c_int,
    add_tensor: unsafe extern "C" fn(
        Raw,
        *const c_void,
        Raw,
        *const c_void,
        *const c_void,
        Raw,
        *mut c_void,
    ) -> c_int,
    run: [Run; 3],
    find: [Find; 3],
    heuristic: [Heuristic; 3],
    workspace: [WorkspaceSize; 3],
}

/// What timing the algorithms found.
enum Timed {
    /// The fastest, and the workspace it was timed with (address, bytes).
    Chosen(Choice, u64, usize),
    /// No workspace for the search: the heuristic's choice stays.
    Stay,
    /// No algorithm ran.
    NoneRuns,
}

/// The loaded library.
struct Lib {
    fns: Fns,
    path: String,
    /// major·10000 + minor·100 + patch (92600 for 9.26.0).
    version: usize,
    // Keeps the functions above valid.
    _lib: libloading::Library,
}

/// Why there is no library: none found (convolutions fall back), or one that is broken.
enum Missing {
    NotFound(String),
    Broken(String),
}

fn open() -> std::result::Result<Lib, Missing> {
    let candidates = super::nccl::library_candidates(
        "GRAPHRUN_CUDNN",
        &["libcudnn.so.9", "libcudnn.so"],
        "cudnn",
    );
    let mut tried = vec![];
    for c in candidates {
        let bare = c.components().count() == 1;
        if !bare && !c.exists() {
            continue;
        }
        let path = c.display().to_string();
        // Safety: loading cuDNN runs its (trusted) initialisers only.
        match unsafe { libloading::Library::new(&c) } {
            Ok(lib) => return load(lib, path).map_err(Missing::Broken),
            // A bare name the loader does not know is simply absent; a file that is there
            // but does not load is worth saying.
            Err(_) if bare => tried.push(path),
            Err(e) => return Err(Missing::Broken(format!("{path} does not load: {e}"))),
        }
    }
    Err(Missing::NotFound(format!(
        "tried {} and the nvidia-cudnn wheel folders; pip install nvidia-cudnn-cu13 or \
         set GRAPHRUN_CUDNN to libcudnn.so.9",
        tried.join(", ")
    )))
}

fn load(lib: libloading::Library, path: String) -> std::result::Result<Lib, String> {
    // Safety: the symbols are cuDNN 9's C API with these signatures (cudnn_graph.h,
    // cudnn_ops.h, cudnn_cnn.h; enums are C ints, descriptors and handles pointers).
    unsafe {
        macro_rules! sym {
            ($name:literal) => {
                *lib.get($name.as_bytes())
                    .map_err(|e| format!("{path} lacks {}: {e}", $name))?
            };
        }
        let fns = Fns {
            get_version: sym!("cudnnGetVersion"),
            error_string: sym!("cudnnGetErrorString"),
            create: sym!("cudnnCreate"),
            destroy: sym!("cudnnDestroy"),
            set_stream: sym!("cudnnSetStream"),
            create_tensor: sym!("cudnnCreateTensorDescriptor"),
            set_tensor: sym!("cudnnSetTensorNdDescriptor"),
            destroy_tensor: sym!("cudnnDestroyTensorDescriptor"),
            create_filter: sym!("cudnnCreateFilterDescriptor"),
            set_filter: sym!("cudnnSetFilterNdDescriptor"),
            destroy_filter: sym!("cudnnDestroyFilterDescriptor"),
            create_conv: sym!("cudnnCreateConvolutionDescriptor"),
            set_conv: sym!("cudnnSetConvolutionNdDescriptor"),
            set_group: sym!("cudnnSetConvolutionGroupCount"),
            set_math: sym!("cudnnSetConvolutionMathType"),
            destroy_conv: sym!("cudnnDestroyConvolutionDescriptor"),
            add_tensor: sym!("cudnnAddTensor"),
            run: [
                sym!("cudnnConvolutionForward"),
                sym!("cudnnConvolutionBackwardData"),
                sym!("cudnnConvolutionBackwardFilter"),
            ],
            find: [
                sym!("cudnnFindConvolutionForwardAlgorithmEx"),
                sym!("cudnnFindConvolutionBackwardDataAlgorithmEx"),
                sym!("cudnnFindConvolutionBackwardFilterAlgorithmEx"),
            ],
            heuristic: [
                sym!("cudnnGetConvolutionForwardAlgorithm_v7"),
                sym!("cudnnGetConvolutionBackwardDataAlgorithm_v7"),
                sym!("cudnnGetConvolutionBackwardFilterAlgorithm_v7"),
            ],
            workspace: [
                sym!("cudnnGetConvolutionForwardWorkspaceSize"),
                sym!("cudnnGetConvolutionBackwardDataWorkspaceSize"),
                sym!("cudnnGetConvolutionBackwardFilterWorkspaceSize"),
            ],
        };
        let version = (fns.get_version)();
        if version < 90000 {
            return Err(format!("{path} is cuDNN {version}; graphrun needs cuDNN 9"));
        }
        Ok(Lib {
            fns,
            path,
            version,
            _lib: lib,
        })
    }
}

/// The library, loaded on first use by the whole process.
fn lib() -> &'static std::result::Result<Lib, Missing> {
    static LIB: OnceLock<std::result::Result<Lib, Missing>> = OnceLock::new();
    LIB.get_or_init(open)
}

impl Lib {
    /// Ok for CUDNN_STATUS_SUCCESS, else an error naming the call, the shape and cuDNN's
    /// message.
    fn check(&self, what: &str, s: &dyn std::fmt::Display, r: c_int) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        // Safety: returns a static string for any code.
        let msg = unsafe { CStr::from_ptr((self.fns.error_string)(r)) }.to_string_lossy();
        crate::bail!(Runtime, "cuDNN {what} failed for {s}: {msg} (status {r})")
    }
}

/// Whether the library was found and loads.
pub fn found() -> bool {
    lib().is_ok()
}

/// One line for `graphrun doctor`.
pub fn doctor_line() -> String {
    match lib() {
        Ok(l) => format!(
            "cuDNN {}.{}.{} ({})",
            l.version / 10000,
            l.version / 100 % 100,
            l.version % 100,
            l.path
        ),
        Err(Missing::NotFound(m)) => {
            format!("cuDNN: not found ({m}): convolutions run as im2col + cuBLASLt")
        }
        Err(Missing::Broken(e)) => format!("cuDNN: unusable: {e}"),
    }
}

/// The chosen algorithm of one `Which` for one shape.
#[derive(Clone, Copy)]
struct Choice {
    algo: c_int,
    math: c_int,
    workspace: usize,
    /// Chosen by timing (FindEx), not by the heuristic (which is kept until the next
    /// call that may time).
    timed: bool,
}

/// A shape's descriptors and algorithms.
struct Plan {
    lib: &'static Lib,
    x: Raw,
    w: Raw,
    y: Raw,
    bias: Raw,
    conv: Raw,
    /// The math type the search starts from.
    math: c_int,
    choice: [Option<Choice>; 3],
    /// The convolutions whose timing found no algorithm that runs (cuDNN lists
    /// heuristic choices it then cannot run, e.g. some f64 grouped shapes): the caller's
    /// fallback takes them.
    refused: [bool; 3],
}

impl Drop for Plan {
    fn drop(&mut self) {
        let f = &self.lib.fns;
        // Safety: each descriptor is this plan's own (or null, never created).
        unsafe {
            for d in [self.x, self.y, self.bias] {
                if !d.is_null() {
                    (f.destroy_tensor)(d);
                }
            }
            if !self.w.is_null() {
                (f.destroy_filter)(self.w);
            }
            if !self.conv.is_null() {
                (f.destroy_conv)(self.conv);
            }
        }
    }
}

impl Plan {
    /// Descriptors (first, second, result) and pointers (first, second) of `which`'s
    /// call, from the caller's a, b: Forward (X, W → Y), Data (W, dY → dX), Filter
    /// (X, dY → dW).
    fn operands(&self, which: Which, a: u64, b: u64) -> (Raw, Raw, Raw, u64, u64) {
        match which {
            Which::Forward => (self.x, self.w, self.y, a, b),
            Which::Data => (self.w, self.y, self.x, b, a),
            Which::Filter => (self.x, self.y, self.w, a, b),
        }
    }
}

/// cuDNN on one backend's stream: a handle bound to it and the plans of the shapes seen.
pub struct Cudnn {
    lib: &'static Lib,
    handle: Raw,
    stream: Arc<CudaStream>,
    /// f32 convolutions may use TF32 tensor cores (`--dtype tf32`).
    tf32: bool,
    /// Per shape its plan, or why cuDNN cannot take it.
    plans: Mutex<HashMap<ConvShape, std::result::Result<Plan, String>>>,
}

impl Drop for Cudnn {
    fn drop(&mut self) {
        let _ = self.stream.context().bind_to_thread();
        if let Ok(mut plans) = self.plans.lock() {
            plans.clear();
        }
        // Safety: the handle is ours; its plans are gone and nothing runs on it after.
        unsafe { (self.lib.fns.destroy)(self.handle) };
    }
}

/// Dims with a leading 1 when there is one spatial axis: 1-D runs as 2-D.
fn spatial(v: &[usize], fill: usize) -> Vec<usize> {
    if v.len() == 1 {
        vec![fill, v[0]]
    } else {
        v.to_vec()
    }
}

fn ints(v: &[usize]) -> Vec<c_int> {
    v.iter().map(|&d| d as c_int).collect()
}

/// Contiguous strides of `dims` (given N, C, spatial...), of the layout they are stored in:
/// channels-first, or channels-last (C the innermost).
fn strides(dims: &[c_int], channels_last: bool) -> Vec<c_int> {
    let order: Vec<usize> = match channels_last {
        false => (0..dims.len()).collect(),
        true => [0].into_iter().chain(2..dims.len()).chain([1]).collect(),
    };
    let mut s = vec![1; dims.len()];
    let mut step = 1;
    for &d in order.iter().rev() {
        s[d] = step;
        step *= dims[d];
    }
    s
}

fn data_type(dt: DType) -> Option<c_int> {
    Some(match dt {
        DType::F16 => DATA_HALF,
        DType::BF16 => DATA_BFLOAT16,
        DType::F32 => DATA_FLOAT,
        DType::F64 => DATA_DOUBLE,
        _ => return None,
    })
}

/// The geometry cuDNN takes (`Cudnn::supports` less the algorithm check).
fn takes(s: &ConvShape) -> bool {
    let r = s.image.len();
    let axes_ok = (1..=3).contains(&r)
        && [&s.kernel, &s.out, &s.pads, &s.strides, &s.dilations]
            .iter()
            .all(|v| v.len() == r);
    let positive = [s.n, s.c, s.m, s.group].iter().all(|&d| d > 0)
        && [&s.image, &s.kernel, &s.out, &s.strides, &s.dilations]
            .iter()
            .all(|v| v.iter().all(|&d| d > 0));
    // f64 grouped convolutions go to the fallback: cuDNN 9 accepts some (a depthwise 1-D
    // one with a bias, on the H200) and then fails them with EXECUTION_FAILED.
    let f64_grouped = s.dt == DType::F64 && s.group > 1;
    // Its channels-last kernels are for the types tensor cores take.
    let f64_nhwc = s.dt == DType::F64 && s.nhwc;
    if data_type(s.dt).is_none()
        || f64_grouped
        || f64_nhwc
        || !axes_ok
        || !positive
        || !s.c.is_multiple_of(s.group)
        || !s.m.is_multiple_of(s.group)
    {
        return false;
    }
    // Y's size must be what cuDNN computes from the rest (it rejects anything else).
    let fits = (0..r).all(|i| {
        let span = s.dilations[i].saturating_mul(s.kernel[i] - 1) + 1;
        let padded = s.image[i].saturating_add(s.pads[i].saturating_mul(2));
        padded >= span && (padded - span) / s.strides[i] + 1 == s.out[i]
    });
    let small = |dims: &[usize]| {
        dims.iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .is_some_and(|e| e <= i32::MAX as usize)
    };
    let sizes_ok = small(&[&[s.n, s.c][..], &s.image].concat())
        && small(&[&[s.m, s.c / s.group][..], &s.kernel].concat())
        && small(&[&[s.n, s.m][..], &s.out].concat())
        && s.pads.iter().all(|&p| p <= i32::MAX as usize / 2);
    fits && sizes_ok
}

impl Cudnn {
    /// None when no cuDNN library is found (then convolutions use the fallback); Err when
    /// it is found but cannot be set up (the message names the file and cuDNN's error).
    pub fn new(stream: &Arc<CudaStream>, tf32: bool) -> Result<Option<Cudnn>> {
        let lib = match lib() {
            Ok(l) => l,
            Err(Missing::NotFound(_)) => return Ok(None),
            Err(Missing::Broken(m)) => crate::bail!(Runtime, "cuDNN: {m}"),
        };
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| crate::err!(Runtime, "CUDA context for cuDNN: {e:?}"))?;
        let mut handle: Raw = std::ptr::null_mut();
        let at = &lib.path;
        // Safety: plain cuDNN calls; the stream outlives the handle (kept below).
        unsafe {
            lib.check("set-up (cudnnCreate)", &at, (lib.fns.create)(&mut handle))?;
            let r = (lib.fns.set_stream)(handle, stream.cu_stream() as Raw);
            if r != 0 {
                (lib.fns.destroy)(handle);
                lib.check("set-up (cudnnSetStream)", &at, r)?;
            }
        }
        Ok(Some(Cudnn {
            lib,
            handle,
            stream: stream.clone(),
            tf32,
            plans: Mutex::new(HashMap::new()),
        }))
    }

    /// Whether cuDNN takes this convolution: a float dtype, 1 to 3 spatial axes, sizes
    /// that fit its 32-bit indexing, Y's size matching the geometry, and an algorithm for
    /// each of the three convolutions (so that training never meets one it lacks).
    pub fn supports(&self, s: &ConvShape) -> bool {
        if self.stream.context().bind_to_thread().is_err() {
            return false;
        }
        let Ok(mut plans) = self.plans.lock() else {
            return false;
        };
        self.plan(&mut plans, s).is_ok()
    }

    /// The plan of `s`, made on first sight: its descriptors and the heuristic's
    /// algorithm for each `Which` (an error where one has none).
    fn plan<'a>(
        &self,
        plans: &'a mut HashMap<ConvShape, std::result::Result<Plan, String>>,
        s: &ConvShape,
    ) -> Result<&'a mut Plan> {
        let entry = plans
            .entry(s.clone())
            .or_insert_with(|| self.make_plan(s).map_err(|e| e.to_string()));
        entry.as_mut().map_err(|m| crate::err!(Runtime, "{m}"))
    }

    fn make_plan(&self, s: &ConvShape) -> Result<Plan> {
        let (lib, f) = (self.lib, &self.lib.fns);
        let Some(dt) = data_type(s.dt).filter(|_| takes(s)) else {
            crate::bail!(Runtime, "cuDNN does not take the {s}");
        };
        let math = match s.dt {
            DType::F16 | DType::BF16 => TENSOR_OP_MATH,
            // True FP32 must not round through TF32 (CUDNN_DEFAULT_MATH allows it on
            // Ampere and newer).
            DType::F32 if !self.tf32 => FMA_MATH,
            _ => DEFAULT_MATH,
        };
        let mut p = Plan {
            lib,
            x: std::ptr::null_mut(),
            w: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            bias: std::ptr::null_mut(),
            conv: std::ptr::null_mut(),
            math,
            choice: [None; 3],
            refused: [false; 3],
        };
        let x = ints(&[&[s.n, s.c][..], &spatial(&s.image, 1)].concat());
        let w = ints(&[&[s.m, s.c / s.group][..], &spatial(&s.kernel, 1)].concat());
        let y = ints(&[&[s.n, s.m][..], &spatial(&s.out, 1)].concat());
        let mut bias = vec![1; y.len()];
        bias[1] = s.m as c_int;
        let pads = ints(&spatial(&s.pads, 0));
        let conv_strides = ints(&spatial(&s.strides, 1));
        let dilations = ints(&spatial(&s.dilations, 1));
        // Safety: each descriptor is created before it is set; the arrays have the
        // lengths passed; a partly made plan is destroyed by its Drop.
        unsafe {
            for (d, dims) in [(&mut p.x, &x), (&mut p.y, &y), (&mut p.bias, &bias)] {
                lib.check("tensor descriptor", s, (f.create_tensor)(d))?;
                let st = strides(dims, s.nhwc);
                let r = (f.set_tensor)(*d, dt, dims.len() as c_int, dims.as_ptr(), st.as_ptr());
                lib.check("tensor descriptor (cudnnSetTensorNdDescriptor)", s, r)?;
            }
            lib.check("filter descriptor", s, (f.create_filter)(&mut p.w))?;
            let format = if s.nhwc { TENSOR_NHWC } else { TENSOR_NCHW };
            let r = (f.set_filter)(p.w, dt, format, w.len() as c_int, w.as_ptr());
            lib.check("filter descriptor (cudnnSetFilterNdDescriptor)", s, r)?;
            lib.check("convolution descriptor", s, (f.create_conv)(&mut p.conv))?;
            let compute = if s.dt == DType::F64 {
                DATA_DOUBLE
            } else {
                DATA_FLOAT
            };
            let r = (f.set_conv)(
                p.conv,
                pads.len() as c_int,
                pads.as_ptr(),
                conv_strides.as_ptr(),
                dilations.as_ptr(),
                CROSS_CORRELATION,
                compute,
            );
            lib.check(
                "convolution descriptor (cudnnSetConvolutionNdDescriptor)",
                s,
                r,
            )?;
            let r = (f.set_group)(p.conv, s.group as c_int);
            lib.check("group count (cudnnSetConvolutionGroupCount)", s, r)?;
        }
        for which in [Which::Forward, Which::Data, Which::Filter] {
            p.choice[which as usize] = Some(self.heuristic(&p, which, s)?);
        }
        Ok(p)
    }

    /// The first usable algorithm of `perf` (fastest first), with its math type.
    fn pick(&self, s: &ConvShape, perf: &[Perf], room: usize) -> Option<(c_int, c_int)> {
        let strict = s.dt == DType::F32 && !self.tf32;
        perf.iter()
            .find(|q| {
                q.status == 0
                    && q.memory <= room
                    && !(strict
                        && [TENSOR_OP_MATH, TENSOR_OP_MATH_ALLOW_CONVERSION].contains(&q.math))
            })
            // cuDNN asks to run an algorithm under the math type it reports; true FP32
            // stays on FMA whatever it reports (its DEFAULT allows TF32).
            .map(|q| (q.algo, if strict { FMA_MATH } else { q.math }))
    }

    /// `algo`'s workspace under math type `math` (set on the descriptor), at least `hint`.
    fn workspace(
        &self,
        p: &Plan,
        which: Which,
        s: &ConvShape,
        algo: c_int,
        hint: usize,
    ) -> Result<usize> {
        let f = &self.lib.fns;
        let (d1, d2, dr, _, _) = p.operands(which, 0, 0);
        let mut bytes = 0usize;
        // Safety: the descriptors are the plan's.
        let r = unsafe {
            (f.workspace[which as usize])(self.handle, d1, d2, p.conv, dr, algo, &mut bytes)
        };
        self.lib.check("workspace size query", s, r)?;
        Ok(bytes.max(hint))
    }

    fn set_math(&self, p: &Plan, s: &ConvShape, math: c_int) -> Result<()> {
        // Safety: the descriptor is the plan's.
        let r = unsafe { (self.lib.fns.set_math)(p.conv, math) };
        self.lib
            .check("math type (cudnnSetConvolutionMathType)", s, r)
    }

    /// The `_v7` heuristic's choice: no GPU work, so it may run while a CUDA graph is
    /// being recorded.
    fn heuristic(&self, p: &Plan, which: Which, s: &ConvShape) -> Result<Choice> {
        self.set_math(p, s, p.math)?;
        let (d1, d2, dr, _, _) = p.operands(which, 0, 0);
        let mut perf = [Perf::default(); 16];
        let mut n = 0;
        // Safety: `perf` has room for the count requested.
        let r = unsafe {
            (self.lib.fns.heuristic[which as usize])(
                self.handle,
                d1,
                d2,
                p.conv,
                dr,
                perf.len() as c_int,
                &mut n,
                perf.as_mut_ptr(),
            )
        };
        self.lib.check("algorithm heuristic", s, r)?;
        let found = &perf[..(n.max(0) as usize).min(perf.len())];
        let Some((algo, math)) = self.pick(s, found, WORKSPACE_CAP) else {
            crate::bail!(Runtime, "cuDNN has no {which:?} algorithm for {s}");
        };
        self.set_math(p, s, math)?;
        let workspace = self.workspace(p, which, s, algo, 0)?;
        Ok(Choice {
            algo,
            math,
            workspace,
            timed: false,
        })
    }

    /// The fastest algorithm by timing each (`Find…AlgorithmEx`) on the call's own
    /// buffers; it writes the result buffer, which the call then overwrites. Also the
    /// workspace it timed with (address, bytes), for the call to reuse. `Stay` where that
    /// workspace cannot be had (a nearly full GPU): the heuristic's choice then stays;
    /// `NoneRuns` where no algorithm ran.
    fn timed(
        &self,
        p: &Plan,
        which: Which,
        s: &ConvShape,
        (a, b, out): (u64, u64, u64),
        scratch: &dyn Fn(usize) -> Result<u64>,
    ) -> Result<Timed> {
        let f = &self.lib.fns;
        self.set_math(p, s, p.math)?;
        let (d1, d2, dr, p1, p2) = p.operands(which, a, b);
        // Room for the hungriest algorithm under the cap (not the cap itself: the scratch
        // pool keeps its largest buffer).
        let mut room = 0;
        for algo in 0..ALGO_COUNT[which as usize] {
            let mut bytes = 0usize;
            // Safety: the descriptors are the plan's; unsupported algorithms just fail.
            let r = unsafe {
                (f.workspace[which as usize])(self.handle, d1, d2, p.conv, dr, algo, &mut bytes)
            };
            if r == 0 && bytes <= WORKSPACE_CAP {
                room = room.max(bytes);
            }
        }
        let ws = match room {
            0 => 0,
            _ => match scratch(room) {
                Ok(ws) => ws,
                Err(_) => return Ok(Timed::Stay),
            },
        };
        let mut perf = [Perf::default(); 16];
        let mut n = 0;
        // Safety: the pointers are the caller's device buffers of `s`'s sizes, the
        // workspace has `room` bytes, `perf` room for the count requested.
        let r = unsafe {
            (f.find[which as usize])(
                self.handle,
                d1,
                p1 as *const c_void,
                d2,
                p2 as *const c_void,
                p.conv,
                dr,
                out as *mut c_void,
                perf.len() as c_int,
                &mut n,
                perf.as_mut_ptr(),
                ws as *mut c_void,
                room,
            )
        };
        self.lib
            .check("algorithm search (Find…AlgorithmEx)", s, r)?;
        let found = &perf[..(n.max(0) as usize).min(perf.len())];
        let Some((algo, math)) = self.pick(s, found, room) else {
            return Ok(Timed::NoneRuns);
        };
        let memory = found
            .iter()
            .find(|q| q.algo == algo)
            .map_or(0, |q| q.memory);
        self.set_math(p, s, math)?;
        let workspace = self.workspace(p, which, s, algo, memory)?;
        let choice = Choice {
            algo,
            math,
            workspace,
            timed: true,
        };
        Ok(Timed::Chosen(choice, ws, room))
    }

    /// Forward: `out` = Y = conv(`a` = X, `b` = W) (+ `bias` [m] broadcast, when given).
    /// Data: `out` = dX from `a` = dY and `b` = W.
    /// Filter: `out` = dW from `a` = X and `b` = dY.
    /// Pointers are device addresses; `scratch(bytes)` returns a device address of at
    /// least `bytes` for the workspace, valid until the call's work has run. False (and
    /// nothing run) where cuDNN has no algorithm that runs this convolution.
    #[allow(clippy::too_many_arguments)]
    pub fn conv(
        &self,
        which: Which,
        s: &ConvShape,
        a: u64,
        b: u64,
        out: u64,
        bias: Option<u64>,
        scratch: &dyn Fn(usize) -> Result<u64>,
    ) -> Result<bool> {
        if bias.is_some() && which != Which::Forward {
            crate::bail!(
                Runtime,
                "cuDNN: a bias is added to a forward convolution only"
            );
        }
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| crate::err!(Runtime, "CUDA context for cuDNN: {e:?}"))?;
        let mut plans = self
            .plans
            .lock()
            .map_err(|_| crate::err!(Runtime, "cuDNN plan table poisoned"))?;
        let p = self.plan(&mut plans, s)?;
        let i = which as usize;
        if p.refused[i] {
            return Ok(false);
        }
        // Timing runs the convolution several times: not while a CUDA graph is being
        // recorded (launches are not run then), nor where the result overwrites an
        // operand; the heuristic's choice serves until a call that may time.
        // Safety: the stream is ours; only its capture status is read.
        let capturing =
            unsafe { cudarc::driver::result::stream::is_capturing(self.stream.cu_stream()) }
                .map(|st| {
                    st != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
                })
                .unwrap_or(true);
        // The search's workspace serves the run that follows it (one pool buffer, not two).
        let (choice, ws) = match p.choice[i] {
            Some(c) if c.timed || capturing || out == a || out == b => (c, None),
            Some(c) => match self.timed(p, which, s, (a, b, out), scratch)? {
                Timed::Chosen(t, ws, room) => {
                    p.choice[i] = Some(t);
                    (t, (room >= t.workspace).then_some(ws))
                }
                Timed::Stay => {
                    p.choice[i] = Some(Choice { timed: true, ..c });
                    (c, None)
                }
                Timed::NoneRuns => {
                    p.refused[i] = true;
                    return Ok(false);
                }
            },
            None => crate::bail!(Runtime, "cuDNN: no {which:?} plan for the {s}"),
        };
        self.set_math(p, s, choice.math)?;
        let ws = match ws {
            Some(ws) => ws,
            None if choice.workspace > 0 => scratch(choice.workspace)?,
            None => 0,
        };
        // Scaling factors are double for double data, float otherwise.
        let (one64, zero64, one32, zero32) = (1f64, 0f64, 1f32, 0f32);
        let (one, zero): (*const c_void, *const c_void) = if s.dt == DType::F64 {
            (&one64 as *const f64 as _, &zero64 as *const f64 as _)
        } else {
            (&one32 as *const f32 as _, &zero32 as *const f32 as _)
        };
        let f = &self.lib.fns;
        let (d1, d2, dr, p1, p2) = p.operands(which, a, b);
        // Safety: the pointers are the caller's device buffers of `s`'s sizes on this
        // handle's stream, the workspace has the bytes cuDNN asked for; the scaling
        // factors outlive the (synchronous) calls that read them.
        unsafe {
            let run = || {
                (f.run[i])(
                    self.handle,
                    one,
                    d1,
                    p1 as *const c_void,
                    d2,
                    p2 as *const c_void,
                    p.conv,
                    choice.algo,
                    ws as *mut c_void,
                    choice.workspace,
                    zero,
                    dr,
                    out as *mut c_void,
                )
            };
            let mut r = run();
            if r == EXECUTION_FAILED {
                // cuDNN reports CUDA's per-thread last error after its launch, and that
                // error can be stale: while other threads load kernels, a candidate of
                // its algorithm search may fail (CUDA error 901) and leave it set. The
                // report has cleared it; a second call tells a real failure.
                r = run();
            }
            let what = [
                "cudnnConvolutionForward",
                "cudnnConvolutionBackwardData",
                "cudnnConvolutionBackwardFilter",
            ][i];
            if (NOT_SUPPORTED..EXECUTION_FAILED).contains(&r) {
                // The algorithm found does not run this convolution after all (seen on
                // an H100: cuDNN 9's backward data of a stride-2 2×2 f32 convolution,
                // INTERNAL_ERROR). Nothing was written: the caller's fallback takes this
                // shape from now on.
                p.refused[i] = true;
                return Ok(false);
            }
            self.lib.check(what, s, r)?;
            if let Some(bias) = bias {
                let r = (f.add_tensor)(
                    self.handle,
                    one,
                    p.bias,
                    bias as *const c_void,
                    one,
                    p.y,
                    out as *mut c_void,
                );
                self.lib.check("bias (cudnnAddTensor)", s, r)?;
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Loads the library where there is one (no GPU needed): every symbol resolves and it
    /// is cuDNN 9.
    #[test]
    fn loads_cudnn_9() {
        match lib() {
            Ok(l) => {
                // Safety: cudnnGetVersion reads a constant.
                let v = unsafe { (l.fns.get_version)() };
                assert!(v >= 90000, "{} reports version {v}", l.path);
                println!("{}", doctor_line());
            }
            Err(Missing::NotFound(m)) => println!("cuDNN not found ({m}); skipped"),
            Err(Missing::Broken(m)) => panic!("cuDNN is there but unusable: {m}"),
        }
    }

    /// The perf struct's layout is the header's (int, int, float, size_t, int, int, int[3]).
    #[test]
    fn perf_layout() {
        assert_eq!(std::mem::size_of::<Perf>(), 48);
        assert_eq!(std::mem::offset_of!(Perf, memory), 16);
        assert_eq!(std::mem::offset_of!(Perf, math), 28);
    }

    /// The geometry check, which needs no GPU.
    #[test]
    fn takes_float_geometries_only() {
        let ok = shape(
            DType::F32,
            [2, 4, 6, 2],
            &[&[9, 7], &[3, 2], &[1, 0], &[2, 1], &[1, 2]],
        );
        assert_eq!(ok.out, [5, 5]);
        assert!(takes(&ok));
        assert!(takes(&ConvShape {
            dt: DType::BF16,
            ..ok.clone()
        }));
        assert!(!takes(&ConvShape {
            dt: DType::I32,
            ..ok.clone()
        }));
        // f64: ungrouped only.
        assert!(!takes(&ConvShape {
            dt: DType::F64,
            ..ok.clone()
        }));
        assert!(takes(&ConvShape {
            dt: DType::F64,
            c: 2,
            m: 3,
            group: 1,
            ..ok.clone()
        }));
        assert!(!takes(&ConvShape {
            out: vec![5, 6],
            ..ok.clone()
        }));
        assert!(!takes(&ConvShape {
            group: 3,
            ..ok.clone()
        }));
        assert!(!takes(&ConvShape {
            kernel: vec![0, 2],
            ..ok.clone()
        }));
        assert!(!takes(&ConvShape {
            n: 1 << 20,
            c: 1 << 12,
            ..ok.clone()
        }));
        let four = vec![1; 4];
        assert!(!takes(&ConvShape {
            image: four.clone(),
            kernel: four.clone(),
            out: four.clone(),
            pads: vec![0; 4],
            strides: four.clone(),
            dilations: four,
            ..ok
        }));
    }

    /// Elements of `dt` as bytes, and the values they hold.
    fn encode(dt: DType, v: &[f64]) -> (Vec<u8>, Vec<f64>) {
        let mut bytes = vec![];
        let mut held = vec![];
        for &x in v {
            let h = match dt {
                DType::F64 => {
                    bytes.extend(x.to_le_bytes());
                    x
                }
                DType::F32 => {
                    bytes.extend((x as f32).to_le_bytes());
                    x as f32 as f64
                }
                DType::F16 => {
                    let h = half::f16::from_f64(x);
                    bytes.extend(h.to_le_bytes());
                    h.to_f64()
                }
                _ => {
                    let h = half::bf16::from_f64(x);
                    bytes.extend(h.to_le_bytes());
                    h.to_f64()
                }
            };
            held.push(h);
        }
        (bytes, held)
    }

    fn decode(dt: DType, b: &[u8]) -> Vec<f64> {
        let k = dt.size();
        b.chunks(k)
            .map(|c| match dt {
                DType::F64 => f64::from_le_bytes(c.try_into().unwrap()),
                DType::F32 => f32::from_le_bytes(c.try_into().unwrap()) as f64,
                DType::F16 => half::f16::from_le_bytes([c[0], c[1]]).to_f64(),
                _ => half::bf16::from_le_bytes([c[0], c[1]]).to_f64(),
            })
            .collect()
    }

    /// Y = conv(X, W), dX and dW (from dY) by the definition, in f64.
    fn reference(s: &ConvShape, x: &[f64], w: &[f64], dy: &[f64]) -> [Vec<f64>; 3] {
        let pad3 = |v: &[usize], fill: usize| {
            let mut a = vec![fill; 3 - v.len()];
            a.extend(v);
            a
        };
        let (im, k, o) = (pad3(&s.image, 1), pad3(&s.kernel, 1), pad3(&s.out, 1));
        let (p, st, d) = (pad3(&s.pads, 0), pad3(&s.strides, 1), pad3(&s.dilations, 1));
        let (cg, mg) = (s.c / s.group, s.m / s.group);
        let (isz, ksz, osz) = (
            im.iter().product::<usize>(),
            k.iter().product::<usize>(),
            o.iter().product::<usize>(),
        );
        let mut y = vec![0.0; s.n * s.m * osz];
        let mut dx = vec![0.0; x.len()];
        let mut dw = vec![0.0; w.len()];
        for n in 0..s.n {
            for m in 0..s.m {
                let g = m / mg;
                for oi in 0..osz {
                    let oc = [oi / (o[1] * o[2]), oi / o[2] % o[1], oi % o[2]];
                    let yi = (n * s.m + m) * osz + oi;
                    for ci in 0..cg {
                        let c = g * cg + ci;
                        for ki in 0..ksz {
                            let kc = [ki / (k[1] * k[2]), ki / k[2] % k[1], ki % k[2]];
                            let mut at = [0usize; 3];
                            let mut inside = true;
                            for a in 0..3 {
                                let i = (oc[a] * st[a] + kc[a] * d[a]) as isize - p[a] as isize;
                                inside &= i >= 0 && (i as usize) < im[a];
                                at[a] = i.max(0) as usize;
                            }
                            if !inside {
                                continue;
                            }
                            let xi = (n * s.c + c) * isz + (at[0] * im[1] + at[1]) * im[2] + at[2];
                            let wi = (m * cg + ci) * ksz + ki;
                            y[yi] += x[xi] * w[wi];
                            dx[xi] += dy[yi] * w[wi];
                            dw[wi] += x[xi] * dy[yi];
                        }
                    }
                }
            }
        }
        [y, dx, dw]
    }

    /// The largest difference relative to the largest reference value.
    fn error(got: &[f64], want: &[f64]) -> f64 {
        let scale = want.iter().fold(1e-30f64, |a, v| a.max(v.abs()));
        got.iter()
            .zip(want)
            .fold(0f64, |a, (g, w)| a.max((g - w).abs()))
            / scale
    }

    /// A shape of `dt` from [n, c, m, group] and [image, kernel, pads, strides,
    /// dilations], Y's size computed.
    fn shape(dt: DType, [n, c, m, group]: [usize; 4], v: &[&[usize]; 5]) -> ConvShape {
        let [image, kernel, pads, strides, dilations] = v.map(|a| a.to_vec());
        let out = (0..image.len())
            .map(|i| (image[i] + 2 * pads[i] - dilations[i] * (kernel[i] - 1) - 1) / strides[i] + 1)
            .collect();
        ConvShape {
            dt,
            n,
            c,
            m,
            group,
            image,
            kernel,
            out,
            pads,
            strides,
            dilations,
            nhwc: false,
        }
    }

    /// `v` viewed as `[batch, rows, cols]`, transposed to `[batch, cols, rows]`.
    fn swap(v: &[f64], batch: usize, rows: usize, cols: usize) -> Vec<f64> {
        let mut out = vec![0.0; v.len()];
        for b in 0..batch {
            for r in 0..rows {
                for c in 0..cols {
                    out[(b * cols + c) * rows + r] = v[(b * rows + r) * cols + c];
                }
            }
        }
        out
    }

    /// On a GPU with cuDNN: the three convolutions (and the bias) match the definition
    /// for each dtype, 1-D to 3-D, grouped, strided, dilated and padded; true FP32 stays
    /// within FP32's error (TF32 would not); a call recorded into a CUDA graph (the
    /// heuristic's algorithm) replays to the same result. Skipped without a GPU.
    #[test]
    fn gpu_matches_definition() {
        use cudarc::driver::{CudaSlice, DevicePtr};
        if let Err(e) = super::super::device::available() {
            println!("no GPU ({e}); skipped");
            return;
        }
        let dev = super::super::device::device().unwrap();
        let stream = dev.ctx.new_stream().unwrap();
        let Some(dnn) = Cudnn::new(&stream, false).unwrap() else {
            println!("{}; skipped", doctor_line());
            return;
        };
        println!("{}", doctor_line());
        // One workspace for every call, allocated before any capture.
        let work: CudaSlice<u8> = stream.alloc_zeros(WORKSPACE_CAP + 4096).unwrap();
        let work_p = work.device_ptr(&stream).0;
        let scratch = |bytes: usize| -> Result<u64> {
            assert!(bytes <= WORKSPACE_CAP + 4096, "workspace {bytes}");
            Ok(work_p)
        };
        let mut seed = 12345u64;
        let mut rand = |len: usize| -> Vec<f64> {
            (0..len)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (seed >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
                })
                .collect()
        };
        let geometries: [([usize; 4], [&[usize]; 5]); 4] = [
            ([2, 4, 6, 2], [&[9, 7], &[3, 2], &[1, 0], &[2, 1], &[1, 2]]),
            ([3, 5, 4, 1], [&[17], &[4], &[2], &[3], &[2]]),
            (
                [1, 3, 3, 3],
                [&[5, 6, 4], &[3, 3, 2], &[1, 1, 0], &[1, 1, 1], &[1, 1, 1]],
            ),
            (
                [8, 32, 64, 1],
                [&[28, 28], &[3, 3], &[1, 1], &[1, 1], &[1, 1]],
            ),
        ];
        for dt in [DType::F64, DType::F32, DType::F16, DType::BF16] {
            let tol = match dt {
                DType::F64 => 1e-12,
                DType::F32 => 2e-5,
                DType::F16 => 4e-3,
                _ => 3e-2,
            };
            // Each geometry channels-first, then (but f64) channels-last: the data and
            // the results transposed here.
            let layouts = geometries
                .iter()
                .enumerate()
                .flat_map(|g| [(g, false), (g, true)])
                .filter(|&(_, nhwc)| !nhwc || dt != DType::F64);
            for ((gi, (sizes, v)), nhwc) in layouts {
                let s = ConvShape {
                    nhwc,
                    ..shape(dt, *sizes, v)
                };
                // f64 grouped convolutions go to the fallback (`takes`).
                if s.dt == DType::F64 && s.group > 1 {
                    assert!(!dnn.supports(&s), "{s}");
                    continue;
                }
                assert!(dnn.supports(&s), "{s}");
                let (n, c, m, group) = (s.n, s.c, s.m, s.group);
                let (pi, k, po) = (
                    s.image.iter().product::<usize>(),
                    s.kernel.iter().product::<usize>(),
                    s.out.iter().product::<usize>(),
                );
                let (xs, ws, ys) = (n * c * pi, m * (c / group) * k, n * m * po);
                let (x, w, dy) = (rand(xs), rand(ws), rand(ys));
                // Stored channels-last where `nhwc` (to_last), read back (to_first).
                let to_last = |v: &[f64], b, ch, sp| match nhwc {
                    true => swap(v, b, ch, sp),
                    false => v.to_vec(),
                };
                let to_first = |v: &[f64], b, sp, ch| match nhwc {
                    true => swap(v, b, sp, ch),
                    false => v.to_vec(),
                };
                let (xb, x) = encode(dt, &to_last(&x, n, c, pi));
                let (wb, w) = encode(dt, &to_last(&w, m, c / group, k));
                let (dyb, dy) = encode(dt, &to_last(&dy, n, m, po));
                let (x, w, dy) = (
                    to_first(&x, n, pi, c),
                    to_first(&w, m, k, c / group),
                    to_first(&dy, n, po, m),
                );
                let (bb, bias) = encode(dt, &rand(m));
                let [mut y, dx, dw] = reference(&s, &x, &w, &dy);
                for (i, v) in y.iter_mut().enumerate() {
                    *v += bias[i / po % m];
                }
                let up = |b: &[u8]| stream.clone_htod(b).unwrap();
                let (xd, wd, dyd, bd) = (up(&xb), up(&wb), up(&dyb), up(&bb));
                let (yd, dxd, dwd): (CudaSlice<u8>, CudaSlice<u8>, CudaSlice<u8>) = (
                    stream.alloc_zeros(ys * dt.size()).unwrap(),
                    stream.alloc_zeros(xs * dt.size()).unwrap(),
                    stream.alloc_zeros(ws * dt.size()).unwrap(),
                );
                let ptr = |b: &CudaSlice<u8>| b.device_ptr(&stream).0;
                // The last geometry is recorded into a CUDA graph (the heuristic's
                // algorithms, as no timed choice exists yet) and replayed.
                let record = gi == geometries.len() - 1 && dt == DType::F32 && !nhwc;
                if record {
                    stream
                        .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                        .unwrap();
                }
                dnn.conv(
                    Which::Forward,
                    &s,
                    ptr(&xd),
                    ptr(&wd),
                    ptr(&yd),
                    Some(ptr(&bd)),
                    &scratch,
                )
                .unwrap();
                dnn.conv(
                    Which::Data,
                    &s,
                    ptr(&dyd),
                    ptr(&wd),
                    ptr(&dxd),
                    None,
                    &scratch,
                )
                .unwrap();
                dnn.conv(
                    Which::Filter,
                    &s,
                    ptr(&xd),
                    ptr(&dyd),
                    ptr(&dwd),
                    None,
                    &scratch,
                )
                .unwrap();
                if record {
                    let graph = stream
                        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
                        .unwrap()
                        .unwrap();
                    graph.launch().unwrap();
                    assert!(dnn.plans.lock().unwrap()[&s]
                        .as_ref()
                        .unwrap()
                        .choice
                        .iter()
                        .all(|c| !c.unwrap().timed));
                }
                let down = |b: &CudaSlice<u8>| decode(dt, &stream.clone_dtoh(b).unwrap());
                let errs = [
                    error(&to_first(&down(&yd), n, po, m), &y),
                    error(&to_first(&down(&dxd), n, pi, c), &dx),
                    error(&to_first(&down(&dwd), m, k, c / group), &dw),
                ];
                println!(
                    "{s}: errors {:.1e} {:.1e} {:.1e}",
                    errs[0], errs[1], errs[2]
                );
                assert!(
                    errs.iter().all(|&e| e <= tol),
                    "{s}: errors {errs:?} over {tol}"
                );
            }
        }
    }
}
