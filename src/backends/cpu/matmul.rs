//! Matrix products on the `gemm` crate (multi-threaded): MatMul (batched, broadcasting),
//! Gemm, and FusedMatMul with its epilogue. f16/bf16 are widened to f32.

use super::elementwise::todo_kernel;
use crate::error::Result;
use crate::graph::Activation;
use crate::tensor::Tensor;

pub fn matmul(a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()> {
    todo_kernel("matmul")
}
#[allow(clippy::too_many_arguments)]
pub fn gemm(a: &Tensor, b: &Tensor, c: Option<&Tensor>, alpha: f32, beta: f32, trans_a: bool, trans_b: bool, out: &mut Tensor) -> Result<()> {
    todo_kernel("gemm")
}
pub fn fused_matmul(a: &Tensor, b: &Tensor, bias: Option<&Tensor>, residual: Option<&Tensor>, act: Activation, trans_b: bool, out: &mut Tensor) -> Result<()> {
    todo_kernel("fused_matmul")
}
/// Measures this machine's f32 GEMM rate (GFLOP/s) on an n×n×n product: median of `iters`.
pub fn gemm_f32_gflops(n: usize, iters: usize) -> f64 {
    0.0
}
