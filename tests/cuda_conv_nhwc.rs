//! CUDA convolutions forced onto cuDNN's channels-last kernels (`Tuning::cuda_conv =
//! "nhwc"`: the transposed copies, and the copy back that adds the bias, the residual and
//! the activation), against the CPU: its own test executable, since the tuning is
//! process-wide. A 16/32-bit convolution the way cannot run fails instead of falling back.
//! Skips where there is no GPU or no cuDNN (fails there under GRAPHRUN_REQUIRE_CUDA).

mod common;
#[path = "common/conv_matrix.rs"]
mod conv_matrix;

#[test]
fn channels_last_convolutions_match_the_cpu() {
    if !common::cuda_present() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let lines = graphrun::backends::cuda::doctor_lines();
    if let Some(l) = lines.iter().find(|l| l.starts_with("cuDNN: not found")) {
        assert!(
            std::env::var_os("GRAPHRUN_REQUIRE_CUDA").is_none(),
            "GRAPHRUN_REQUIRE_CUDA is set but {l}"
        );
        eprintln!("skipped: {l}");
        return;
    }
    graphrun::set_tuning(graphrun::Tuning {
        cuda_conv: "nhwc".into(),
        ..graphrun::tuning()
    });
    conv_matrix::convolutions_match_the_cpu(&[graphrun::BackendKind::Cuda]);
}
