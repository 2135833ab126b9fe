//! The CUDA backend: buffers are device byte slices, kernels are the CUDA C sources of
//! `cuda/` compiled by NVRTC (device.rs), matrix products go through cuBLASLt (matmul.rs).
//! Everything runs on one stream per backend instance. The driver, NVRTC and cuBLASLt
//! are loaded at run time, so this builds without a toolkit and fails with one line
//! where there is no GPU.
//!
//! The steady state is a pure sequence of launches: scratch comes from a pool that only
//! grows (steps.rs), the training step number lives on the device, and kernels report
//! bad input (labels, indices) through a flag the host reads after the step; so a step
//! can be captured as a CUDA graph and replayed (steps.rs). A node that still has to
//! read a value back (a Slice's starts, a Gather's indices) marks its step as one that
//! cannot be recorded, and that step simply runs eagerly.

pub(crate) mod attention;
mod conv;
mod cudnn;
pub(crate) mod device;
mod elementwise;
mod matmul;
pub mod nccl;
mod optim;
mod reduce;
mod shape;
mod steps;

pub use cudnn::found as cudnn_found;
pub use device::{available, device_count, doctor_lines};

use super::Backend;
use crate::error::Result;
use crate::graph::infer::ValueType;
use crate::graph::{Node, Op, Optimizer};
use crate::tensor::{DType, Tensor};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use device::{Arg, Device};
use std::sync::Arc;

/// The CUDA backend: one instance per session (or data-parallel worker), with its own
/// stream on a process-wide device.
pub struct Cuda {
    dev: Arc<Device>,
    stream: Arc<CudaStream>,
    blas: matmul::Blas,
    /// The mode of the next runs (`Backend::set_step`): 0 is inference, t ≥ 1 training
    /// step t, mixed into Dropout's seed.
    step: u64,
    /// Scratch, step parameters, the error flag and recorded steps (steps.rs).
    steps: steps::Steps,
    /// Data-parallel training: this worker's communicator (exec/parallel.rs).
    comm: Option<Collectives>,
    /// SGD updates held back to go out together at `flush_updates` (optim.rs).
    sgd: optim::Pending,
    /// The optimizer kernels' non-finite note: the smallest slot whose update left a NaN
    /// or an infinity, u32::MAX for none (`Backend::take_nonfinite`).
    nonfinite: CudaSlice<u32>,
    /// cuDNN for convolutions, set up at the first one (`None` inside: not found).
    dnn: std::cell::OnceCell<Option<cudnn::Cudnn>>,
    /// Per convolution shape (and whether its tensors are channels-last), the way that
    /// ran it fastest at its first eager call (conv.rs).
    conv_choice: std::cell::RefCell<
        std::collections::HashMap<(cudnn::Which, cudnn::ConvShape, bool), conv::Way>,
    >,
}

/// A worker's NCCL communicator and the side stream its gradient averages run on, so
/// that they overlap the rest of the backward pass: each average waits (`ready`) for the
/// launches that made its gradients, and the optimizer update waits (`done`) for all.
struct Collectives {
    comm: Arc<nccl::Comm>,
    stream: Arc<CudaStream>,
    ready: cudarc::driver::CudaEvent,
    done: cudarc::driver::CudaEvent,
    /// Averages issued since the last `comm_wait`.
    pending: bool,
}

/// One operand of a node as the kernels see it: its device address and type, and for
/// inputs the buffer (read back to the host where an op's small parameters live there).
#[derive(Clone, Copy)]
pub(crate) struct V<'a> {
    pub p: u64,
    pub ty: &'a ValueType,
    buf: Option<&'a CudaSlice<u8>>,
}

impl V<'_> {
    pub fn dtype(&self) -> DType {
        self.ty.dtype
    }
    pub fn shape(&self) -> &[usize] {
        &self.ty.shape
    }
    pub fn numel(&self) -> usize {
        self.ty.numel()
    }
}

impl Cuda {
    /// A backend on CUDA device 0, with true FP32 matrix products.
    pub fn new() -> Result<Cuda> {
        Cuda::with_options(false)
    }

    /// `tf32`: f32 matrix products may use TF32 tensor cores (PyTorch's
    /// `allow_tf32`); otherwise they are true FP32.
    pub fn with_options(tf32: bool) -> Result<Cuda> {
        Cuda::on(0, tf32)
    }

    /// A backend on CUDA device `ordinal`.
    pub fn on(ordinal: usize, tf32: bool) -> Result<Cuda> {
        let dev = device::device_on(ordinal)?;
        let stream = dev
            .ctx
            .new_stream()
            .map_err(|e| crate::err!(Runtime, "cannot create a CUDA stream: {e:?}"))?;
        let blas = matmul::Blas::new(&stream, tf32)?;
        let steps = steps::Steps::new(&stream)?;
        let nonfinite = stream
            .clone_htod(&[u32::MAX])
            .map_err(|e| crate::err!(Runtime, "CUDA allocation failed: {e:?}"))?;
        Ok(Cuda {
            dev,
            stream,
            blas,
            step: 0,
            steps,
            comm: None,
            sgd: Default::default(),
            nonfinite,
            dnn: Default::default(),
            conv_choice: Default::default(),
        })
    }

    fn nonfinite_ptr(&self) -> u64 {
        self.addr(&self.nonfinite)
    }

    /// Makes this backend a data-parallel worker: `all_reduce` and `broadcast` run on
    /// `comm`, whose device must be this backend's.
    pub fn set_comm(&mut self, comm: Arc<nccl::Comm>) -> Result<()> {
        let ctx = &self.dev.ctx;
        let e = |e| crate::err!(Runtime, "CUDA stream for NCCL: {e:?}");
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        // The highest priority: NCCL's blocks then take SMs as soon as a kernel of the
        // backward pass frees them, instead of queueing behind its whole grid.
        ctx.bind_to_thread().map_err(e)?;
        // (`Tuning::dp_stream_priority` overrides it, for measuring: 0 is the default.)
        let (_, greatest) = cudarc::driver::result::stream::get_priority_range().map_err(e)?;
        let greatest = crate::backends::tuning::tuning()
            .dp_stream_priority
            .unwrap_or(greatest);
        self.comm = Some(Collectives {
            comm,
            stream: ctx.new_stream_with_priority(greatest).map_err(e)?,
            ready: ctx.new_event(flags).map_err(e)?,
            done: ctx.new_event(flags).map_err(e)?,
            pending: false,
        });
        Ok(())
    }

    /// Issues a collective on the communicator's own stream, after the launches issued
    /// so far (`comm_wait` orders later launches after it).
    fn on_comm_stream(
        &mut self,
        bufs: &[(&CudaSlice<u8>, &ValueType)],
        op: impl FnOnce(&nccl::Comm, &[(u64, usize, nccl::DataType)], &CudaStream) -> Result<()>,
    ) -> Result<()> {
        let s = self.stream.clone();
        let bufs = nccl_bufs(bufs, &s)?;
        let c = self.collectives()?;
        // One rank has nothing to average (its shard is everything).
        if c.comm.ranks == 1 {
            return Ok(());
        }
        let e = |e| crate::err!(Runtime, "CUDA event: {e:?}");
        c.ready.record(&s).map_err(e)?;
        c.stream.wait(&c.ready).map_err(e)?;
        op(&c.comm, &bufs, &c.stream)?;
        c.pending = true;
        Ok(())
    }

    fn collectives(&mut self) -> Result<&mut Collectives> {
        self.comm
            .as_mut()
            .ok_or_else(|| crate::err!(Runtime, "this cuda backend has no NCCL communicator"))
    }

    fn launch(&self, name: &str, grid: u32, block: u32, args: &[Arg]) -> Result<()> {
        device::launch(&self.dev, &self.stream, name, grid, block, args)
    }

    /// Launches an elementwise kernel over `n` elements (grid-stride).
    fn launch_n(&self, name: &str, n: usize, args: &[Arg]) -> Result<()> {
        self.launch(name, device::grid_for(n), 256, args)
    }

    /// A device copy of host data (small parameter arrays: ids, cu_seqlens). Not
    /// recordable in a CUDA graph: marks the step.
    fn upload_vec<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        v: &[T],
    ) -> Result<CudaSlice<T>> {
        self.steps.mark_unrecordable();
        // A zero-length allocation is not a valid device buffer.
        if v.is_empty() {
            return self.zeros::<T>(1);
        }
        self.stream.clone_htod(v).map_err(oom)
    }

    /// Zeroed scratch of `n` elements, allocated now (not recordable: marks the step;
    /// steady-state paths use `scratch`).
    fn zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>> {
        self.steps.mark_unrecordable();
        self.stream
            .alloc_zeros::<T>(n.max(1))
            .map_err(|e| oom_bytes(n * std::mem::size_of::<T>(), e))
    }

    /// Scratch of `bytes` that lives until the node ends, from the pool (no allocation
    /// once the pool has grown to the step's needs). Not zeroed.
    fn scratch(&self, bytes: usize) -> Result<u64> {
        self.steps.scratch(&self.stream, bytes)
    }

    /// Registers a bad-input message for kernels to raise through the error flag:
    /// `{v}` in `msg` becomes the offending value. Returns (flag address, code).
    fn error_code(&self, msg: String) -> (u64, u64) {
        self.steps.error_code(msg)
    }

    fn addr<T>(&self, b: &CudaSlice<T>) -> u64 {
        use cudarc::driver::DevicePtr;
        b.device_ptr(&self.stream).0
    }

    /// Reads an input back to the host: for the few ops whose small parameters decide
    /// offsets (Slice starts, Reduce axes, Gather indices for their range check, ...).
    fn read(&self, v: &V) -> Result<Tensor> {
        self.steps.mark_unrecordable();
        let Some(b) = v.buf else {
            crate::bail!(Runtime, "internal: output read as an input");
        };
        download(&self.stream, b, v.ty)
    }

    /// Runs `run` once to warm up, then times three more runs on the stream (ms, read
    /// back at once); `None` when the warm-up run says it cannot run (false). For the
    /// first eager call of a shape choosing between ways (cuBLASLt algorithms, cuDNN).
    fn time_runs(&self, run: &dyn Fn() -> Result<bool>) -> Result<Option<f32>> {
        let ev = |e| crate::err!(Runtime, "CUDA event failed: {e:?}");
        let ctx = self.stream.context();
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let (t0, t1) = (
            ctx.new_event(flags).map_err(ev)?,
            ctx.new_event(flags).map_err(ev)?,
        );
        if !run()? {
            return Ok(None);
        }
        t0.record(&self.stream).map_err(ev)?;
        for _ in 0..3 {
            run()?;
        }
        t1.record(&self.stream).map_err(ev)?;
        Ok(Some(t0.elapsed_ms(&t1).map_err(ev)?))
    }

    /// cuDNN on this backend's stream, set up at the first call; `None` where the library
    /// is not found.
    fn cudnn(&self) -> Result<Option<&cudnn::Cudnn>> {
        if self.dnn.get().is_none() {
            let d = cudnn::Cudnn::new(&self.stream, self.blas.tf32())?;
            let _ = self.dnn.set(d);
        }
        Ok(self.dnn.get().and_then(Option::as_ref))
    }

    fn memset0(&self, v: &V) -> Result<()> {
        self.memset(v, 0)
    }

    /// Every byte of `v` set to `byte`.
    fn memset(&self, v: &V, byte: u8) -> Result<()> {
        let bytes = v.ty.bytes();
        if bytes == 0 {
            return Ok(());
        }
        // Safety: `v.p` addresses a live buffer of at least `bytes` bytes (the plan sized it).
        unsafe {
            cudarc::driver::result::memset_d8_async(v.p, byte, bytes, self.stream.cu_stream())
        }
        .map_err(|e| crate::err!(Runtime, "CUDA memset failed: {e:?}"))
    }

    fn copy(&self, dst: &V, src: &V) -> Result<()> {
        let bytes = dst.ty.bytes().min(src.ty.bytes());
        if bytes == 0 {
            return Ok(());
        }
        // Safety: both address live buffers of at least `bytes` bytes; outputs never alias
        // inputs.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst.p, src.p, bytes, self.stream.cu_stream())
        }
        .map_err(|e| crate::err!(Runtime, "CUDA copy failed: {e:?}"))
    }

    /// `rows` rows of `width` bytes at `dst` (rows `pitch` bytes apart) set to zero, on the
    /// stream.
    fn zero_rows(&self, dst: u64, pitch: usize, width: usize, rows: usize) -> Result<()> {
        if width == 0 || rows == 0 {
            return Ok(());
        }
        let stream = self.stream.cu_stream();
        // Safety: `dst` addresses a live device buffer holding `rows` rows at `pitch`.
        let r = unsafe {
            if rows == 1 {
                cudarc::driver::sys::cuMemsetD8Async(dst, 0, width, stream)
            } else {
                cudarc::driver::sys::cuMemsetD2D8Async(dst, pitch, 0, width, rows, stream)
            }
        };
        r.result()
            .map_err(|e| crate::err!(Runtime, "CUDA memset of {rows} rows failed: {e:?}"))
    }

    /// `rows` rows of `width` bytes from `src` (rows `src_pitch` bytes apart) to `dst`
    /// (rows `dst_pitch` apart), on the stream.
    fn copy_rows(
        &self,
        src: u64,
        src_pitch: usize,
        dst: u64,
        dst_pitch: usize,
        width: usize,
        rows: usize,
    ) -> Result<()> {
        use cudarc::driver::sys;
        if width == 0 || rows == 0 {
            return Ok(());
        }
        let device = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: device,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: device,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch,
            WidthInBytes: width,
            Height: rows,
        };
        // Safety: both address live device buffers holding `rows` rows at their pitches.
        unsafe { sys::cuMemcpy2DAsync_v2(&copy, self.stream.cu_stream()) }
            .result()
            .map_err(|e| crate::err!(Runtime, "CUDA copy of {rows} rows failed: {e:?}"))
    }
}

fn oom(e: cudarc::driver::DriverError) -> crate::error::Error {
    crate::err!(Runtime, "CUDA allocation failed: {e:?}")
}

fn oom_bytes(bytes: usize, e: cudarc::driver::DriverError) -> crate::error::Error {
    crate::err!(
        Runtime,
        "CUDA out of memory allocating {bytes} bytes of scratch: {e:?}"
    )
}

fn download(stream: &Arc<CudaStream>, b: &CudaSlice<u8>, ty: &ValueType) -> Result<Tensor> {
    let n = ty.bytes();
    let mut host = vec![0u8; n];
    if n > 0 {
        stream
            .memcpy_dtoh(&b.slice(..n), &mut host)
            .map_err(|e| crate::err!(Runtime, "CUDA download failed: {e:?}"))?;
        stream
            .synchronize()
            .map_err(|e| crate::err!(Runtime, "CUDA error: {e:?}"))?;
    }
    Tensor::from_bytes(ty.dtype, &ty.shape, &host)
}

/// The error for an op this backend does not run in a dtype (SPEC §7: no silent fallback).
pub(crate) fn unsupported(node: &Node, dt: DType) -> crate::error::Error {
    crate::err!(
        Runtime,
        "{}: dtype {dt} is not supported by the cuda backend",
        node.describe()
    )
}

impl Backend for Cuda {
    type Buffer = CudaSlice<u8>;
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn alloc(&mut self, bytes: usize) -> Result<CudaSlice<u8>> {
        // Safety: every buffer is written (upload or a kernel) before it is read.
        unsafe { self.stream.alloc::<u8>(bytes.max(1)) }.map_err(|e| {
            crate::err!(
                Runtime,
                "CUDA out of memory allocating {bytes} bytes: {e:?}"
            )
        })
    }
    fn upload(&mut self, src: &Tensor, dst: &mut CudaSlice<u8>) -> Result<()> {
        let n = src.size_bytes();
        if n == 0 {
            return Ok(());
        }
        self.stream
            .memcpy_htod(src.bytes(), &mut dst.slice_mut(..n))
            .map_err(|e| crate::err!(Runtime, "CUDA upload failed: {e:?}"))
    }
    fn download(&mut self, src: &CudaSlice<u8>, ty: &ValueType) -> Result<Tensor> {
        download(&self.stream, src, ty)
    }
    fn run(
        &mut self,
        node: &Node,
        ins: &[Option<(&CudaSlice<u8>, &ValueType)>],
        outs: &mut [(&mut CudaSlice<u8>, &ValueType)],
    ) -> Result<()> {
        self.steps.node_begins();
        let s = &self.stream;
        let ins: Vec<Option<V>> = ins
            .iter()
            .map(|i| {
                i.map(|(b, ty)| V {
                    p: device::ptr(b, s),
                    ty,
                    buf: Some(b),
                })
            })
            .collect();
        let outs: Vec<V> = outs
            .iter()
            .map(|(b, ty)| V {
                p: device::ptr(b, s),
                ty,
                buf: None,
            })
            .collect();
        let types = ins.iter().flatten().map(|v| v.ty);
        super::common::refuse_narrow(node, "cuda", types.chain(outs.iter().map(|v| v.ty)))?;
        // Which outputs the graph reads (an optional output named "" is not computed).
        let want: Vec<bool> = node.outputs.iter().map(|o| !o.is_empty()).collect();
        self.run_node(node, &ins, &outs, &want)
    }
    fn sync(&mut self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| crate::err!(Runtime, "CUDA error: {e:?}"))?;
        if let Some(c) = &self.comm {
            c.comm.async_error()?;
        }
        self.steps.check_error()
    }
    fn all_reduce(&mut self, bufs: &[(&CudaSlice<u8>, &ValueType)]) -> Result<()> {
        self.on_comm_stream(bufs, |comm, bufs, s| comm.all_reduce_avg(bufs, s))
    }
    fn reduce_scatter(&mut self, bufs: &[(&CudaSlice<u8>, &ValueType)]) -> Result<()> {
        self.on_comm_stream(bufs, |comm, bufs, s| comm.reduce_to_shards(bufs, s))
    }
    fn shard(&self, n: usize) -> std::ops::Range<usize> {
        match &self.comm {
            Some(c) => nccl::shard(n, c.comm.ranks, c.comm.rank),
            None => 0..n,
        }
    }
    fn update_part(
        &mut self,
        opt: &Optimizer,
        t: u64,
        param: &mut CudaSlice<u8>,
        grad: &CudaSlice<u8>,
        state: &mut [CudaSlice<u8>],
        ty: &ValueType,
        slot: u32,
        part: std::ops::Range<usize>,
    ) -> Result<()> {
        let s = &self.stream;
        let state: Vec<u64> = state.iter().map(|b| device::ptr(b, s)).collect();
        let off = (part.start * ty.dtype.size()) as u64;
        let (p, g) = (device::ptr(param, s) + off, device::ptr(grad, s) + off);
        let ty = ValueType::new(ty.dtype, &[part.len()]);
        optim::update(self, opt, t, p, g, &state, &ty, slot)
    }
    fn gather_shards(&mut self, bufs: &[(&CudaSlice<u8>, &ValueType)]) -> Result<()> {
        // On the compute stream itself: the updates before it (held-back SGD issued
        // first), the next step's launches after it.
        optim::flush(self)?;
        let s = self.stream.clone();
        let bufs = nccl_bufs(bufs, &s)?;
        let c = self.collectives()?;
        if c.comm.ranks == 1 {
            return Ok(());
        }
        c.comm.gather_shards(&bufs, &s)
    }
    fn comm_wait(&mut self) -> Result<()> {
        let s = self.stream.clone();
        let Some(c) = self.comm.as_mut().filter(|c| c.pending) else {
            return Ok(());
        };
        let e = |e| crate::err!(Runtime, "CUDA event: {e:?}");
        c.done.record(&c.stream).map_err(e)?;
        s.wait(&c.done).map_err(e)?;
        c.pending = false;
        Ok(())
    }
    fn broadcast(&mut self, buf: &mut CudaSlice<u8>, ty: &ValueType) -> Result<()> {
        let s = self.stream.clone();
        let p = device::ptr(buf, &s);
        // Any dtype travels as bytes.
        let (n, dt) = (ty.bytes(), nccl::DataType::U8);
        let c = self.collectives()?;
        c.comm.broadcast(p, n, dt, 0, &s)
    }
    fn update(
        &mut self,
        opt: &Optimizer,
        t: u64,
        param: &mut CudaSlice<u8>,
        grad: &CudaSlice<u8>,
        state: &mut [CudaSlice<u8>],
        ty: &ValueType,
        slot: u32,
    ) -> Result<()> {
        let s = &self.stream;
        let state: Vec<u64> = state.iter().map(|b| device::ptr(b, s)).collect();
        let (p, g) = (device::ptr(param, s), device::ptr(grad, s));
        optim::update(self, opt, t, p, g, &state, ty, slot)
    }
    fn accumulate(
        &mut self,
        acc: &mut CudaSlice<u8>,
        grad: &CudaSlice<u8>,
        ty: &ValueType,
        scale: f64,
        first: bool,
    ) -> Result<()> {
        let s = &self.stream;
        let (a, g) = (device::ptr(acc, s), device::ptr(grad, s));
        optim::accumulate(self, a, g, ty, scale, first)
    }
    fn take_nonfinite(&mut self) -> Result<Option<u32>> {
        let err = |e| crate::err!(Runtime, "CUDA copy failed: {e:?}");
        let v = self.stream.clone_dtoh(&self.nonfinite).map_err(err)?;
        if v[0] == u32::MAX {
            return Ok(None);
        }
        self.stream
            .memcpy_htod(&[u32::MAX], &mut self.nonfinite)
            .map_err(err)?;
        Ok(Some(v[0]))
    }
    fn flush_updates(&mut self) -> Result<()> {
        optim::flush(self)
    }
    fn held_bytes(&self) -> usize {
        matmul::WORKSPACE + self.steps.scratch_bytes()
    }
    fn set_step(&mut self, step: u64) {
        self.step = step;
        self.steps.set_step(&self.stream, step);
    }
    fn begin_step(&mut self, key: u64) -> Result<bool> {
        // Dropout's launches differ between inference and training.
        let key = key ^ ((self.step > 0) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.steps.begin(&self.stream, key)
    }
    fn end_step(&mut self, ok: bool) -> Result<bool> {
        self.steps.end(&self.stream, ok)
    }
}

impl Cuda {
    fn run_node(
        &mut self,
        node: &Node,
        ins: &[Option<V>],
        outs: &[V],
        want: &[bool],
    ) -> Result<()> {
        let x = |i: usize| super::common::required(node, ins, i);
        let opt = |i: usize| ins.get(i).copied().flatten();
        let y = outs[0];
        match &node.op {
            Op::Unary(u) => elementwise::unary(self, node, *u, &x(0)?, &y),
            Op::Binary(b) => elementwise::binary(self, node, *b, &x(0)?, &x(1)?, &y),
            Op::Clip => elementwise::clip(self, node, &x(0)?, opt(1), opt(2), &y),
            Op::Where => elementwise::where_(self, &x(0)?, &x(1)?, &x(2)?, &y),
            Op::Rotary { interleaved } | Op::RotaryGrad { interleaved } => {
                let t = matches!(node.op, Op::RotaryGrad { .. });
                elementwise::rotary(self, [&x(0)?, &x(1)?, &x(2)?], *interleaved, t, &y)
            }
            Op::Cast { .. } | Op::CastLike => elementwise::cast(self, &x(0)?, &y),
            Op::Range => elementwise::range(self, node, &x(0)?, &x(2)?, &y),
            Op::NonZero
            | Op::Unique { .. }
            | Op::NonMaxSuppression { .. }
            | Op::ResizeMatrix { .. } => super::common::plan_time_only(node),
            Op::Cumulative {
                prod,
                exclusive,
                reverse,
            } => elementwise::cumulative(
                self,
                node,
                &x(0)?,
                &x(1)?,
                *prod,
                [*exclusive, *reverse],
                &y,
            ),
            Op::ArgReduce {
                min,
                axis,
                select_last_index,
                ..
            } => reduce::arg_reduce(self, node, &x(0)?, *axis, *min, *select_last_index, &y),
            Op::TopK { axis, largest, .. } => {
                reduce::topk(self, node, &x(0)?, *axis, *largest, outs)
            }
            Op::Identity
            | Op::BitCast { .. }
            | Op::Reshape { .. }
            | Op::Squeeze { .. }
            | Op::Unsqueeze { .. }
            | Op::Flatten { .. } => self.copy(&y, &x(0)?),
            Op::Constant { value } => {
                // (Constants are folded by the plan: this runs only for unplanned graphs.)
                let b = self.upload_vec(value.bytes())?;
                let src = V {
                    p: self.addr(&b),
                    ty: y.ty,
                    buf: None,
                };
                self.copy(&y, &src)
            }
            Op::Dropout { ratio, seed } => {
                elementwise::dropout(self, node, &x(0)?, opt(1), opt(2), outs, *ratio, *seed)
            }
            Op::Random {
                normal, a, b, seed, ..
            } => elementwise::random(self, node, (*normal, *a, *b), *seed, &y),
            Op::Trilu { upper } => elementwise::trilu(self, &x(0)?, opt(1), *upper, &y),
            Op::MatMul => matmul::matmul(self, node, &x(0)?, &x(1)?, &y),
            Op::Gemm {
                alpha,
                beta,
                trans_a,
                trans_b,
            } => matmul::gemm(
                self,
                node,
                &x(0)?,
                &x(1)?,
                opt(2),
                *alpha,
                *beta,
                *trans_a,
                *trans_b,
                &y,
            ),
            Op::FusedMatMul {
                activation,
                trans_b,
            } => matmul::fused(
                self,
                node,
                &x(0)?,
                &x(1)?,
                opt(2),
                opt(3),
                *activation,
                *trans_b,
                outs,
                want,
            ),
            Op::GatedMatMul {
                activation,
                trans_b,
            } => matmul::gated(
                self,
                node,
                &x(0)?,
                [&x(1)?, &x(2)?],
                [opt(3), opt(4)],
                *activation,
                *trans_b,
                outs,
                want,
            ),
            Op::GatedMatMulGrad { activation, .. } => elementwise::glu(
                self,
                *activation,
                Some(&x(0)?),
                [&x(1)?, &x(2)?],
                &[&outs[0], &outs[1]],
            ),
            Op::FusedMatMulGrad {
                activation,
                trans_b,
                a_activation,
            } => matmul::fused_grad(
                self,
                node,
                &x(0)?,
                &x(1)?,
                &x(2)?,
                opt(3),
                *activation,
                *trans_b,
                opt(4).map(|p| (p, *a_activation)),
                outs,
                want,
            ),
            Op::Softmax { axis } => reduce::softmax(self, node, &x(0)?, *axis, false, &y),
            Op::LogSoftmax { axis } => reduce::softmax(self, node, &x(0)?, *axis, true, &y),
            Op::SoftmaxGrad { axis, log } => {
                reduce::softmax_grad(self, node, &x(0)?, &x(1)?, *axis, *log, &y)
            }
            Op::LayerNormalization {
                axis,
                epsilon,
                rms,
                residual,
            } => {
                let (b, r) = crate::graph::op::norm_optional_inputs(*rms, *residual);
                reduce::layer_norm(
                    self,
                    node,
                    &x(0)?,
                    &x(1)?,
                    b.and_then(opt),
                    r.map(x).transpose()?,
                    (*axis, *epsilon, *rms),
                    outs,
                    want,
                )
            }
            Op::LayerNormalizationGrad { axis, rms } => {
                let (m, i, r) = crate::graph::op::norm_grad_inputs(*rms);
                reduce::layer_norm_grad(
                    self,
                    node,
                    [&x(0)?, &x(1)?, &x(2)?],
                    (m.map(x).transpose()?, &x(i)?),
                    opt(r),
                    *axis,
                    outs,
                    want,
                )
            }
            Op::Reduce {
                kind,
                axes,
                noop_with_empty_axes,
                ..
            } => {
                let axes = match (axes, opt(1)) {
                    (Some(a), _) => a.clone(),
                    (None, Some(t)) => self.read(&t)?.to_i64_vec(),
                    (None, None) => vec![],
                };
                if axes.is_empty() && *noop_with_empty_axes {
                    return self.copy(&y, &x(0)?);
                }
                reduce::reduce(self, node, *kind, &x(0)?, &axes, &y)
            }
            Op::SoftmaxCrossEntropyLoss {
                reduction,
                ignore_index,
            } => reduce::sce(
                self,
                node,
                &x(0)?,
                &x(1)?,
                opt(2),
                *reduction,
                *ignore_index,
                outs,
                want,
            ),
            Op::SoftmaxCrossEntropyLossGrad {
                reduction,
                ignore_index,
            } => reduce::sce_grad(
                self,
                node,
                &x(0)?,
                &x(1)?,
                &x(2)?,
                opt(3),
                *reduction,
                *ignore_index,
                &y,
            ),
            Op::Transpose { perm } => shape::transpose(self, &x(0)?, perm.as_deref(), &y),
            Op::Concat { axis } => shape::concat(self, ins, *axis, &y),
            Op::Split { axis, .. } => shape::split(self, &x(0)?, *axis, outs),
            Op::Slice => shape::slice(self, &x(0)?, ins, &y),
            Op::SliceGrad => shape::slice_grad(self, &x(0)?, ins, &y),
            Op::Expand => shape::expand(self, &x(0)?, &y),
            Op::Gather { axis } => shape::gather(self, node, &x(0)?, &x(1)?, *axis, &y),
            Op::GatherGrad { axis } => shape::gather_grad(self, node, &x(0)?, &x(1)?, *axis, &y),
            Op::GatherElements { .. } | Op::GatherND { .. } => {
                shape::take(self, node, &x(0)?, &x(1)?, &y)
            }
            Op::GatherElementsGrad { .. } | Op::GatherNDGrad { .. } => {
                shape::take_grad(self, node, &x(0)?, &x(1)?, &y)
            }
            Op::Pad { .. } => shape::pad(self, node, &x(0)?, ins, &y),
            Op::PadGrad { .. } => shape::pad_grad(self, node, &x(0)?, ins, &y),
            Op::Conv { .. } => conv::conv(self, node, &x(0)?, &x(1)?, opt(2), &y),
            Op::FusedConv { activation, .. } => conv::fused_conv(
                self,
                node,
                [&x(0)?, &x(1)?],
                opt(2),
                opt(3),
                *activation,
                outs,
                want,
            ),
            Op::ConvGrad { .. } => {
                conv::conv_grad(self, node, [&x(0)?, &x(1)?, &x(2)?], outs, want)
            }
            Op::Im2Col { .. } => shape::im2col(self, node, &x(0)?, ins, &y),
            Op::MaxPool { .. } => shape::max_pool(self, node, &x(0)?, &y),
            Op::MaxPoolGrad { .. } => shape::max_pool_grad(self, node, &x(0)?, &x(1)?, &y),
            Op::Col2Im { .. } => shape::col2im(self, node, &x(0)?, ins, &y),
            Op::ScatterElements { reduction, .. } | Op::ScatterND { reduction } => {
                shape::scatter(self, node, [&x(0)?, &x(1)?, &x(2)?], *reduction, &y)
            }
            Op::Shape { start, end } => {
                let (s, e) = crate::graph::infer::shape_range(*start, *end, x(0)?.shape().len());
                let dims: Vec<i64> = x(0)?.shape()[s..e].iter().map(|&d| d as i64).collect();
                let b = self.upload_vec(&dims)?;
                let src = V {
                    p: self.addr(&b),
                    ty: y.ty,
                    buf: None,
                };
                self.copy(&y, &src)
            }
            Op::UnaryGrad(u) => elementwise::unary_grad(self, node, *u, &x(0)?, &x(1)?, &y),
            Op::Attention {
                is_causal, scale, ..
            } => attention::attention(
                self,
                node,
                [Some(&x(0)?), opt(1).as_ref(), opt(2).as_ref()],
                opt(3),
                *is_causal,
                *scale,
                outs,
                want,
            ),
            Op::VarlenAttention { is_causal, scale } => attention::varlen(
                self,
                node,
                [&x(0)?, &x(1)?, &x(2)?],
                [&x(3)?, &x(4)?],
                *is_causal,
                *scale,
                outs,
                want,
            ),
            Op::AttentionGrad {
                is_causal, scale, ..
            } => attention::attention_grad(
                self,
                node,
                &x(0)?,
                [Some(&x(1)?), opt(2).as_ref(), opt(3).as_ref()],
                opt(6),
                [&x(4)?, &x(5)?],
                *is_causal,
                *scale,
                outs,
                want,
            ),
            Op::VarlenAttentionGrad { is_causal, scale } => attention::varlen_grad(
                self,
                node,
                [&x(0)?, &x(1)?, &x(2)?, &x(3)?],
                [&x(4)?, &x(5)?],
                [&x(6)?, &x(7)?],
                *is_causal,
                *scale,
                outs,
                want,
            ),
        }
    }
}

/// Buffers as NCCL takes them: (address, element count, NCCL type).
fn nccl_bufs(
    bufs: &[(&CudaSlice<u8>, &ValueType)],
    s: &CudaStream,
) -> Result<Vec<(u64, usize, nccl::DataType)>> {
    bufs.iter()
        .map(|(b, ty)| {
            let dt = nccl::DataType::of(ty.dtype).ok_or_else(|| {
                crate::err!(
                    Runtime,
                    "gradients of dtype {} cannot be averaged",
                    ty.dtype
                )
            })?;
            Ok((device::ptr(b, s), ty.numel(), dt))
        })
        .collect()
}
