//! The Backend trait every device implements: allocate, upload, download, run one node on
//! buffers, synchronize. The executor (src/exec) is the only caller; a backend never sees
//! YAML or passes.

// Launch descriptions shared by the GPU backends, and a few helpers the CPU uses too: in
// a CPU-only build the GPU-only ones are unused.
#[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(dead_code))]
mod common;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
// Without a backend's feature, a stand-in answers every question about its device with
// "built without the feature" (so callers need no cfg of their own).
#[cfg(not(feature = "cuda"))]
#[path = "cuda_off.rs"]
pub mod cuda;
pub mod tuning;
#[cfg(feature = "wgpu")]
pub mod wgpu;
#[cfg(not(feature = "wgpu"))]
#[path = "wgpu_off.rs"]
pub mod wgpu;

use crate::error::Result;
use crate::graph::infer::ValueType;
use crate::graph::{Node, Optimizer};
use crate::tensor::Tensor;

/// The only (backend, dtype) pairs where an operator that takes the dtype may refuse it,
/// with why: every other combination runs (tests/op_matrix.rs holds every elementwise map
/// to this list; README's operator table prints it).
pub const NOT_ON_BACKEND: &[(BackendKind, &[crate::tensor::DType], &str)] = &[(
    BackendKind::Wgpu,
    &[
        crate::tensor::DType::F64,
        crate::tensor::DType::BF16,
        crate::tensor::DType::I64,
        crate::tensor::DType::U64,
    ],
    "WGSL has no 64-bit floats, bfloat16 or 64-bit integers (f16 needs the adapter's SHADER_F16)",
)];

/// Why an op other than a cast or a move refuses a narrow storage type on every backend.
pub(crate) const NARROW_WHY: &str =
    "the 8-, 4- and 2-bit types are storage types, which Cast converts and the shape ops move";

/// Whether `backend` may refuse dtype `dt` (`NOT_ON_BACKEND`).
pub fn not_on(backend: BackendKind, dt: crate::tensor::DType) -> bool {
    NOT_ON_BACKEND
        .iter()
        .any(|(b, dts, _)| *b == backend && dts.contains(&dt))
}

/// `NOT_ON_BACKEND` as the lines under README's operator table.
pub fn not_on_backend_markdown() -> String {
    let mut s = String::from("\nDtypes a backend has no type for (the op refuses them with an error naming node, op and dtype):\n\n");
    for (b, dts, why) in NOT_ON_BACKEND {
        let names: Vec<String> = dts.iter().map(|d| format!("`{d}`")).collect();
        s += &format!("- {}: {} — {why}\n", b.name(), names.join(", "));
    }
    s
}

/// Which backend to run on (SPEC §7).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// The host's CPU (always built).
    Cpu,
    /// An NVIDIA GPU through CUDA (the `cuda` feature).
    Cuda,
    /// A GPU through WebGPU on Vulkan, including Mesa's software lavapipe (the `wgpu`
    /// feature).
    Wgpu,
}

impl BackendKind {
    /// The backend of a name: `cpu`, `cuda`, `wgpu` (or `webgpu`).
    pub fn parse(s: &str) -> Option<BackendKind> {
        match s {
            "cpu" => Some(BackendKind::Cpu),
            "cuda" => Some(BackendKind::Cuda),
            "wgpu" | "webgpu" => Some(BackendKind::Wgpu),
            _ => None,
        }
    }
    /// The backend's name (`cpu`, `cuda`, `wgpu`).
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
            BackendKind::Wgpu => "wgpu",
        }
    }
}

/// A device. Buffers are sized in bytes by the plan and reused across values whose
/// lifetimes do not overlap; the value type passed with each buffer says how to read it.
pub trait Backend {
    /// A device buffer.
    type Buffer;
    /// The backend's name (`BackendKind::name`).
    fn name(&self) -> &'static str;
    /// A buffer of `bytes` bytes (its contents unspecified).
    fn alloc(&mut self, bytes: usize) -> Result<Self::Buffer>;
    /// Copies a host tensor into a buffer large enough for it.
    fn upload(&mut self, src: &Tensor, dst: &mut Self::Buffer) -> Result<()>;
    /// Copies a buffer's value of type `ty` back to the host.
    fn download(&mut self, src: &Self::Buffer, ty: &ValueType) -> Result<Tensor>;
    /// Gives a buffer the type of the value about to be read from it: a view (Reshape and
    /// the like) shares its input's buffer under another shape. Only for backends whose
    /// buffers carry a shape; `run` must still read inputs as their `ValueType` says.
    fn retype(&mut self, _buf: &mut Self::Buffer, _ty: &ValueType) {}
    /// Runs one node. `ins[i]` is `None` for an omitted optional input. Output buffers
    /// never alias input buffers.
    fn run(
        &mut self,
        node: &Node,
        ins: &[Option<(&Self::Buffer, &ValueType)>],
        outs: &mut [(&mut Self::Buffer, &ValueType)],
    ) -> Result<()>;
    /// Waits until everything issued so far has run; errors the device reported since
    /// surface here.
    fn sync(&mut self) -> Result<()>;
    /// One optimizer step on `param` in place (SPEC §4), `t` counting steps from 1.
    /// `state` holds `optimizer_state_len(opt)` buffers of `param`'s shape in
    /// `stat_dtype(param dtype)`, zero before the first step. `slot` numbers the update
    /// within the step: where an updated value is NaN or infinite, the backend notes the
    /// smallest such slot (in the update's own kernel, so the check costs no extra pass)
    /// for `take_nonfinite`.
    #[allow(clippy::too_many_arguments)]
    fn update(
        &mut self,
        opt: &Optimizer,
        t: u64,
        param: &mut Self::Buffer,
        grad: &Self::Buffer,
        state: &mut [Self::Buffer],
        ty: &ValueType,
        slot: u32,
    ) -> Result<()>;
    /// Gradient accumulation over the micro-batches of one step: `acc = scale·grad` when
    /// `first`, else `acc += scale·grad`, in place, both of type `ty` (the gradient's
    /// dtype, as PyTorch accumulates `.grad`). Ordered with the launches around it (a
    /// backend that holds `update`s back issues them first).
    fn accumulate(
        &mut self,
        acc: &mut Self::Buffer,
        grad: &Self::Buffer,
        ty: &ValueType,
        scale: f64,
        first: bool,
    ) -> Result<()>;
    /// The smallest `slot` of an update, since the last call, that left a value NaN or
    /// infinite; clears the note. Waits for the queued updates.
    fn take_nonfinite(&mut self) -> Result<Option<u32>>;
    /// Issues what `update` calls held back (a backend may gather a step's updates into
    /// fewer launches); the executor calls it after the last `update` of a step.
    fn flush_updates(&mut self) -> Result<()> {
        Ok(())
    }
    /// Device memory held outside the memory plan's buffers: scratch pools and library
    /// workspaces (counted into `bench`'s peak).
    fn held_bytes(&self) -> usize {
        0
    }
    /// The mode of the next runs: 0 is inference (Dropout is the identity); t ≥ 1 is
    /// training step t (Dropout applies a mask drawn from its seed and t, so each step
    /// draws a new one, the same on every backend).
    fn set_step(&mut self, step: u64);
    /// Brackets one step: the launches of a plan's nodes (and of a training step's
    /// optimizer updates) that the executor repeats unchanged for as long as `key` (plan,
    /// buffers, step kind) is the same. A backend may record the launches and replay them
    /// itself (CUDA graphs): then this returns true and the executor issues nothing until
    /// `end_step`. The default never replays.
    fn begin_step(&mut self, key: u64) -> Result<bool> {
        let _ = key;
        Ok(false)
    }
    /// Ends the step of `begin_step` after its launches (`ok`: every launch succeeded).
    /// True when the launches were only recorded and the recording failed: the executor
    /// then issues them again, outside any step.
    fn end_step(&mut self, ok: bool) -> Result<bool> {
        let _ = ok;
        Ok(false)
    }
    /// Data-parallel training (exec/parallel.rs): averages each buffer, in place, over
    /// every worker's copy of it. Ordered after the launches issued so far; it may overlap
    /// the launches that follow until `comm_wait`. Backends without a communicator refuse.
    fn all_reduce(&mut self, bufs: &[(&Self::Buffer, &ValueType)]) -> Result<()> {
        let _ = bufs;
        crate::bail!(
            Runtime,
            "the {} backend has no collective communication",
            self.name()
        )
    }
    /// Sharded optimizer (`SessionOptions::shard_optimizer`): the elements of an
    /// `n`-element tensor whose optimizer step this worker owns. Every element where
    /// there is no communicator.
    fn shard(&self, n: usize) -> std::ops::Range<usize> {
        0..n
    }
    /// Sharded optimizer: averages each buffer over the workers into its owners' shards
    /// (`shard`; the rest of the buffer is then undefined). Ordered as `all_reduce`.
    fn reduce_scatter(&mut self, bufs: &[(&Self::Buffer, &ValueType)]) -> Result<()> {
        let _ = bufs;
        crate::bail!(
            Runtime,
            "the {} backend has no collective communication",
            self.name()
        )
    }
    /// Sharded optimizer: `update` on the elements `part` of `param` and `grad` (the
    /// state buffers hold just those elements).
    #[allow(clippy::too_many_arguments)]
    fn update_part(
        &mut self,
        opt: &Optimizer,
        t: u64,
        param: &mut Self::Buffer,
        grad: &Self::Buffer,
        state: &mut [Self::Buffer],
        ty: &ValueType,
        slot: u32,
        part: std::ops::Range<usize>,
    ) -> Result<()> {
        let _ = (opt, t, param, grad, state, ty, slot, part);
        crate::bail!(
            Runtime,
            "the {} backend has no sharded optimizer",
            self.name()
        )
    }
    /// Sharded optimizer, after the updates: each worker's shard of each buffer copied to
    /// every worker, ordered after the launches issued so far and before those that follow.
    fn gather_shards(&mut self, bufs: &[(&Self::Buffer, &ValueType)]) -> Result<()> {
        let _ = bufs;
        crate::bail!(
            Runtime,
            "the {} backend has no collective communication",
            self.name()
        )
    }
    /// Orders the launches that follow after every `all_reduce` issued before.
    fn comm_wait(&mut self) -> Result<()> {
        Ok(())
    }
    /// Data-parallel training: copies the first worker's buffer into every worker's.
    fn broadcast(&mut self, buf: &mut Self::Buffer, ty: &ValueType) -> Result<()> {
        let _ = (buf, ty);
        crate::bail!(
            Runtime,
            "the {} backend has no collective communication",
            self.name()
        )
    }
}

/// How many state buffers an optimizer keeps per parameter.
pub fn optimizer_state_len(opt: &Optimizer) -> usize {
    match opt {
        Optimizer::Sgd { momentum, .. } if *momentum == 0.0 => 0,
        Optimizer::Sgd { .. } => 1,
        Optimizer::Adam { .. } | Optimizer::AdamW { .. } => 2,
    }
}
