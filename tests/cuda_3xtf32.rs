//! f32 attention on the 3xTF32 tensor-core kernels (cuda/flash_tf32.cu, chosen by
//! `Tuning::cuda_attention_f32 = "3xtf32"`, also the f32 default; forced here all the
//! same): the tiled-kernel cases at the f32 tolerance and the accuracy against f64. Its own
//! test executable with one test, since the choice is read once per process. Skips where
//! there is no GPU.

#[path = "common/attention_cuda.rs"]
mod attention_cuda;
mod common;

#[test]
fn attention_3xtf32_tiled_cases_and_accuracy() {
    // Set before any kernel choice is read (the only test of this executable).
    graphrun::set_tuning(graphrun::Tuning {
        cuda_attention_f32: "3xtf32".into(),
        ..graphrun::tuning()
    });
    attention_cuda::tiled_kernels_forward_and_backward();
    attention_cuda::f32_accuracy();
}
