//! Any bytes as a .npy file: an error or a tensor that writes back to the same bytes'
//! meaning (read → write → read is the identity).
#![no_main]
use graphrun::Tensor;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    graphrun::tensor::set_max_bytes(16 << 20);
    if let Ok(t) = Tensor::from_npy_bytes(data) {
        let back = Tensor::from_npy_bytes(&t.to_npy_bytes()).expect("our own .npy reads back");
        assert_eq!(back.dtype(), t.dtype());
        assert_eq!(back.shape(), t.shape());
        assert_eq!(back.bytes(), t.bytes());
    }
});
