//! The Backend trait every device implements: allocate, upload, download, run one node on
//! buffers, synchronize. The executor (src/exec) is the only caller; a backend never sees
//! YAML or passes.

pub mod cpu;

use crate::error::Result;
use crate::graph::infer::ValueType;
use crate::graph::Node;
use crate::tensor::Tensor;

/// Which backend to run on (SPEC §7).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Cuda,
    Wgpu,
}

impl BackendKind {
    pub fn parse(s: &str) -> Option<BackendKind> {
        match s {
            "cpu" => Some(BackendKind::Cpu),
            "cuda" => Some(BackendKind::Cuda),
            "wgpu" | "webgpu" => Some(BackendKind::Wgpu),
            _ => None,
        }
    }
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
    type Buffer;
    fn name(&self) -> &'static str;
    fn alloc(&mut self, bytes: usize) -> Result<Self::Buffer>;
    fn upload(&mut self, src: &Tensor, dst: &mut Self::Buffer) -> Result<()>;
    fn download(&mut self, src: &Self::Buffer, ty: &ValueType) -> Result<Tensor>;
    /// Runs one node. `ins[i]` is `None` for an omitted optional input. Output buffers
    /// never alias input buffers.
    fn run(
        &mut self,
        node: &Node,
        ins: &[Option<(&Self::Buffer, &ValueType)>],
        outs: &mut [(&mut Self::Buffer, &ValueType)],
    ) -> Result<()>;
    fn sync(&mut self) -> Result<()>;
}
