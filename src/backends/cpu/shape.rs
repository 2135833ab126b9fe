//! Data-movement family: Transpose, Concat, Split, Slice, Expand, Gather, Shape. These
//! move bytes, so each is written once over element size rather than per dtype.

use super::elementwise::todo_kernel;
use crate::error::Result;
use crate::graph::Node;
use crate::tensor::Tensor;

pub fn transpose(x: &Tensor, perm: Option<&[usize]>, out: &mut Tensor) -> Result<()> {
    todo_kernel("transpose")
}
pub fn concat(ins: &[Option<&Tensor>], axis: i64, out: &mut Tensor) -> Result<()> {
    todo_kernel("concat")
}
/// Output shapes already hold the split sizes.
pub fn split(x: &Tensor, axis: i64, outs: &mut [Tensor]) -> Result<()> {
    todo_kernel("split")
}
/// `ins` = data, starts, ends, [axes], [steps].
pub fn slice(x: &Tensor, ins: &[Option<&Tensor>], out: &mut Tensor) -> Result<()> {
    todo_kernel("slice")
}
pub fn expand(x: &Tensor, out: &mut Tensor) -> Result<()> {
    todo_kernel("expand")
}
/// Negative indices count from the end; out-of-range indices are an error naming the node.
pub fn gather(node: &Node, x: &Tensor, idx: &Tensor, axis: i64, out: &mut Tensor) -> Result<()> {
    todo_kernel("gather")
}
pub fn shape(x: &Tensor, start: i64, end: Option<i64>, out: &mut Tensor) -> Result<()> {
    todo_kernel("shape")
}
