//! f32 attention on the CUDA-core kernels (cuda/flash.cu fs_*) in both passes, forced by
//! `Tuning::cuda_attention_f32 = "simt"` (by default f32 runs in 3xTF32): the
//! tiled-kernel cases at the f32 tolerance and the accuracy against f64. Its own test
//! executable, since the choice is read once per process. Skips where there is no GPU.

#[path = "common/attention_cuda.rs"]
mod attention_cuda;
mod common;

#[test]
fn attention_simt_tiled_cases_and_accuracy() {
    // Set before any kernel choice is read (the only test of this executable).
    graphrun::set_tuning(graphrun::Tuning {
        cuda_attention_f32: "simt".into(),
        ..graphrun::tuning()
    });
    attention_cuda::tiled_kernels_forward_and_backward();
    attention_cuda::f32_accuracy();
}
