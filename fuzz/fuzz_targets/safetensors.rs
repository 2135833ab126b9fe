//! Any bytes as a .safetensors file: an error or tensors, never a panic.
#![no_main]
use graphrun::Tensor;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    graphrun::tensor::set_max_bytes(16 << 20);
    if let Ok(ts) = Tensor::from_safetensors_bytes(data) {
        for (_, t) in ts {
            assert_eq!(t.size_bytes(), t.numel() * t.dtype().size());
        }
    }
});
