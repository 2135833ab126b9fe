//! Row-wise family: Softmax/LogSoftmax, LayerNormalization, ReduceSum/Mean/Max, and
//! SoftmaxCrossEntropyLoss. One pass per row, f32 (or f64) accumulation.

use super::elementwise::todo_kernel;
use crate::error::Result;
use crate::graph::op::LossReduction;
use crate::graph::{Node, ReduceKind};
use crate::tensor::Tensor;

pub fn softmax(x: &Tensor, axis: i64, log: bool, out: &mut Tensor) -> Result<()> {
    todo_kernel("softmax")
}
/// `outs` holds Y and optionally Mean and InvStdDev.
pub fn layer_norm(x: &Tensor, scale: &Tensor, bias: Option<&Tensor>, axis: i64, eps: f32, outs: &mut [Tensor]) -> Result<()> {
    todo_kernel("layer_norm")
}
/// `axes` are normalised and non-empty; `out` is shaped with or without kept dims.
pub fn reduce(kind: ReduceKind, x: &Tensor, axes: &[usize], out: &mut Tensor) -> Result<()> {
    todo_kernel("reduce")
}
/// `outs` holds the loss and optionally log_prob.
pub fn softmax_cross_entropy(node: &Node, scores: &Tensor, labels: &Tensor, weights: Option<&Tensor>, reduction: LossReduction, ignore_index: Option<i64>, outs: &mut [Tensor]) -> Result<()> {
    todo_kernel("softmax_cross_entropy")
}
