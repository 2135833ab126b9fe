//! Elementwise family: unary and binary maps with numpy broadcasting, Clip, Where,
//! Dropout, Trilu.

use crate::error::Result;
use crate::graph::{BinaryOp, Node, UnaryOp};
use crate::tensor::Tensor;

pub fn unary(op: UnaryOp, x: &Tensor, out: &mut Tensor) -> Result<()> {
    todo_kernel("unary")
}
pub fn binary(op: BinaryOp, a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()> {
    todo_kernel("binary")
}
pub fn clip(x: &Tensor, min: Option<&Tensor>, max: Option<&Tensor>, out: &mut Tensor) -> Result<()> {
    todo_kernel("clip")
}
pub fn where_(c: &Tensor, a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()> {
    todo_kernel("where")
}
/// Identity at inference; in training a mask seeded by `seed` (or the node name).
pub fn dropout(node: &Node, ins: &[Option<&Tensor>], outs: &mut [Tensor], ratio: f32, seed: Option<i64>, training: bool) -> Result<()> {
    todo_kernel("dropout")
}
pub fn trilu(x: &Tensor, k: Option<&Tensor>, upper: bool, out: &mut Tensor) -> Result<()> {
    todo_kernel("trilu")
}
pub(crate) fn todo_kernel(what: &str) -> Result<()> {
    crate::bail!(Runtime, "CPU kernel '{what}' is not written yet")
}
