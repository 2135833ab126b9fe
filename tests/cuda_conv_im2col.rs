//! CUDA convolutions on the path taken where cuDNN is missing (Im2Col columns and
//! cuBLASLt), forced by `Tuning::cuda_conv = "columns"`, against the CPU: its own test
//! executable, since the tuning is process-wide. Skips where there is no GPU.

mod common;
#[path = "common/conv_matrix.rs"]
mod conv_matrix;

#[test]
fn convolutions_without_cudnn_match_the_cpu() {
    if !common::cuda_present() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    graphrun::set_tuning(graphrun::Tuning {
        cuda_conv: "columns".into(),
        ..graphrun::tuning()
    });
    conv_matrix::convolutions_match_the_cpu(&[graphrun::BackendKind::Cuda]);
}
