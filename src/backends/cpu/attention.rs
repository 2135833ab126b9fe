//! Attention in blocked online-softmax form (flash-style): never materialises the
//! Sq×Skv matrix; fully masked rows give 0.

use super::elementwise::todo_kernel;
use crate::error::Result;
use crate::graph::Node;
use crate::tensor::Tensor;

pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, is_causal: bool, scale: Option<f32>, out: &mut Tensor) -> Result<()> {
    todo_kernel("attention")
}
#[allow(clippy::too_many_arguments)]
pub fn varlen_attention(node: &Node, q: &Tensor, k: &Tensor, v: &Tensor, cu_q: &Tensor, cu_k: &Tensor, is_causal: bool, scale: Option<f32>, out: &mut Tensor) -> Result<()> {
    todo_kernel("varlen_attention")
}
