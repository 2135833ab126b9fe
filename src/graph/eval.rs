//! The host evaluator inference and constant folding take as a parameter. Shape inference
//! computes some values while it infers: the small "shape arithmetic" subgraphs exporters
//! emit (Shape → Gather → Concat → Reshape), and NonZero and Unique, whose outputs' shapes
//! are their results. The IR does not run kernels itself: whoever infers passes an
//! evaluator (the CPU backend provides the reference one, `backends::cpu::HOST_EVAL`).

use super::infer::ValueType;
use super::{Node, Op};
use crate::error::Result;
use crate::tensor::Tensor;

/// Plan-time inputs (graph inputs whose values decide shapes) hold at most this many
/// elements: a plan is made, and kept, for each distinct value, so they are meant to be
/// shapes, axes and sizes, not data.
pub const PLAN_INPUT_LIMIT: usize = 1024;

/// Runs nodes on host tensors.
pub trait HostEval: std::fmt::Debug + Sync {
    /// Evaluates `node` on `args` (`None` for an omitted optional input) into outputs of
    /// the types `outs` inference gave.
    fn eval(
        &self,
        node: &Node,
        args: &[Option<&Tensor>],
        outs: &[ValueType],
    ) -> Result<Vec<Tensor>>;
    /// The outputs of NonZero, Unique or NonMaxSuppression (`op`) for inputs `xs` (`None`
    /// for an omitted optional one): their shapes are their results. The error is a
    /// message for the node's inference failure.
    fn eval_data_shaped(
        &self,
        op: &Op,
        xs: &[Option<&Tensor>],
    ) -> std::result::Result<Vec<Tensor>, String>;
}
