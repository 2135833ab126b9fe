//! Kernel-variant switches: which attention kernels run, how many cuBLASLt algorithms are
//! timed, whether steps are recorded as CUDA Graphs, WebGPU tile choices, data-parallel
//! buckets. They exist to compare variants on a device (A/B runs); a user never needs
//! them, since each default is the variant measured best. The library reads them from the
//! process-wide [`Tuning`] set with [`set_tuning`], never from the environment; the
//! `graphrun` CLI sets it from its hidden developer flag `--tune KEY=VALUE` (the keys are
//! the field names; dev/README.md says how the scripts use them).

use std::sync::RwLock;

/// The kernel-variant switches, each at the variant measured best by default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// CUDA attention kernels ("" = the default choice per device and shape). `rows` keeps
    /// every problem on the row-per-warp kernels; `mma` the unmasked tensor-core kernels on
    /// `mma.sync` where wgmma would run. Forward on Hopper: `wg` the one-warpgroup wgmma
    /// kernel instead of the persistent warp-specialized one (cuda/flash.cu fa_fwd_wsp),
    /// `fwspcN` the latter with chunks of N heads. Backward (f16/bf16 on Hopper): `bwd2`
    /// the two deterministic passes (dQ, then dK/dV) instead of one pass with dQ summed by
    /// atomics, `bwd1` that one pass in one warpgroup a 64-key tile (fa_bwd_wg) instead of
    /// the warp-specialized persistent form (fa_bwd_wsp, items from a work counter); `bpst`
    /// that form with items strided over the CTAs, `bp2` / `bps2` either on 2 CTAs (tests:
    /// many items a CTA), `bp10` with LSE and delta loaded by the producer. The default is
    /// the fastest measured on the H100 (docs/bench-h100/attention-notes.md).
    pub cuda_attention: String,
    /// Which kernels take f32 attention (head sizes up to 64) on CUDA ("" = default):
    /// `simt` the CUDA-core FP32 kernels (fs_*), `3xtf32` three TF32 tensor-core passes,
    /// for both passes; `FWD/BWD` (e.g. `3xtf32/simt`) each pass's choice. By default f32
    /// runs in 3xTF32 (FP32-level accuracy, and on the H100 faster than the CUDA-core
    /// kernels in both passes) and `--dtype tf32` in one TF32 pass.
    pub cuda_attention_f32: String,
    /// How many of cuBLASLt's heuristic algorithms are timed, at the first eager call of
    /// each shape of 2³⁰ or more multiply-adds, the fastest kept (1 to 16; 1 keeps the
    /// heuristic's first choice everywhere, as PyTorch does). 6: 1–3 % faster on mlp_large
    /// on the H100; 16 candidates gained nothing more (docs/BENCHMARKS.md).
    pub cublaslt_tune: usize,
    /// dBiasA from cuBLASLt's DGELU_BGRAD epilogue rather than DGELU and our row sum after
    /// it. Off: on the H100 (cuBLAS 13) DGELU_BGRAD made fc2's gradient 0.245 ms slower in
    /// gpt_block and mlp_large bf16 training (0.275 → 0.520 ms), where the row sum costs
    /// about 0.03 ms.
    pub cublaslt_dgelu_bgrad: bool,
    /// Big products with a dimension that is not a multiple of 16 bytes (GPT-2's vocabulary
    /// of 50 257) run on zero-padded copies of their operands (off: as they are, where
    /// cuBLASLt has only kernels several times slower).
    pub cublaslt_align_rows: bool,
    /// Record each CUDA step as a CUDA Graph and replay it (steps that cannot be recorded
    /// run eagerly). On: a replay launches the whole step at once instead of paying the
    /// host cost of every kernel launch, which bounds small steps (mlp_small f32 train
    /// 0.074 ms on the H100, 0.71 × PyTorch's step captured as one CUDA graph;
    /// docs/BENCHMARKS.md).
    pub cuda_graphs: bool,
    /// Print why a CUDA step could not be recorded as a graph (off: it then runs eagerly,
    /// which is correct, only slower).
    pub cuda_graphs_debug: bool,
    /// Keep every WebGPU matrix product on the 64×64 kernel, to compare it with the 128×128
    /// one in one build. Off: on the H100 (Vulkan) the 128×128 kernel ran a 2048³ MatMul
    /// at 27.0 TFLOP/s against 13.7 (docs/WGPU_BENCHMARKS.md).
    pub wgpu_gemm64: bool,
    /// The rows of a WebGPU attention tile (K and V, or Q and dY; clamped to 1..=BQ);
    /// `None` sizes it from the head size, within 8 KiB of workgroup memory forward and
    /// twice that backward. On the H100 (Vulkan) the forward at D = 64 took 22.9 ms with 16
    /// rows, 34.7 with 32 and 64.4 with 64 (more, smaller workgroups per SM), and the
    /// backward 101.8 ms with 32 against 126.6 with 16 (docs/WGPU_BENCHMARKS.md). An
    /// adapter without the workgroup memory for the rows given fails the pipeline.
    pub wgpu_attn_bk: Option<usize>,
    /// Row reductions with subgroup operations where the adapter offers them (off: the
    /// workgroup-memory tree, shaders/rows_tree.wgsl). On: one subgroup operation replaces
    /// the tree's barriers and reruns stay bit-identical; on the H100 no speed difference
    /// was visible either way (docs/WGPU_BENCHMARKS.md).
    pub wgpu_subgroups: bool,
    /// The CLI runs forward-only CUDA graphs with the f32 weights read only as FusedMatMul's
    /// B stored transposed (K-major, `passes::weight_layout`). On: TF32 tensor cores want
    /// both operands K-major; mlp_large tf32 fwd 0.501 → 0.458 ms, gpt_block 1.104 → 1.033
    /// on the H100 (docs/BENCHMARKS.md).
    pub k_major_weights: bool,
    /// The CPU multiplies A by a B stored `[N, K]` (a K-major weight) as dot products of
    /// rows in its own kernel (`backends/cpu/nt.rs`) instead of `gemm`, which would pack
    /// such a B on every call. Off: `gemm` throughout.
    pub cpu_dot_products: bool,
    /// The CUDA stream priority of data-parallel gradient averaging (NCCL); `None` takes
    /// the device's highest, so that with several buckets NCCL's blocks take SMs as soon
    /// as a backward kernel frees them instead of queueing behind its whole grid (with the
    /// default single bucket it made no difference: 2.509 vs 2.492 ms, docs/BENCHMARKS.md).
    pub dp_stream_priority: Option<i32>,
    /// Data-parallel gradients are averaged in buckets of about this many bytes, each
    /// issued once the backward pass has made (and finished reading) all its gradients.
    /// 64 MiB: smaller buckets overlap more communication with the backward pass, but on
    /// two NVLink-connected H200s the NCCL kernels then slow the backward kernels they share
    /// the SMs with by more than they hide (gpt_block bf16, 25 MB of gradients: 2.505 ms a
    /// step with one bucket, 2.564 with 8 MiB buckets, 2.569 with 2 MiB;
    /// docs/BENCHMARKS.md).
    pub dp_bucket_bytes: usize,
    /// How CUDA convolutions run ("" = the fastest way for each shape, timed at its first
    /// eager call): `columns` Im2Col columns in scratch and cuBLASLt products (the path
    /// taken without cuDNN), `cudnn` cuDNN on the channels-first tensors as they are,
    /// `nhwc` cuDNN's channels-last kernels on transposed copies. A way forced here that
    /// cannot run a 16- or 32-bit convolution is an error, so that tests know it ran.
    pub cuda_conv: String,
    /// CUDA sessions with cuDNN keep the activations between convolutions channels-last
    /// (`passes::layout`): transposes only where the layout meets an op that reads
    /// channels first, instead of around every cuDNN call.
    pub channels_last: bool,
}

impl Tuning {
    /// Every switch at its default.
    pub const DEFAULT: Tuning = Tuning {
        cuda_attention: String::new(),
        cuda_attention_f32: String::new(),
        cublaslt_tune: 6,
        cublaslt_dgelu_bgrad: false,
        cublaslt_align_rows: true,
        cuda_graphs: true,
        cuda_graphs_debug: false,
        wgpu_gemm64: false,
        wgpu_attn_bk: None,
        wgpu_subgroups: true,
        k_major_weights: true,
        cpu_dot_products: true,
        dp_stream_priority: None,
        dp_bucket_bytes: 64 << 20,
        cuda_conv: String::new(),
        channels_last: true,
    };

    /// The keys `set` takes: the field names.
    pub const KEYS: [&'static str; 16] = [
        "cuda_attention",
        "cuda_attention_f32",
        "cublaslt_tune",
        "cublaslt_dgelu_bgrad",
        "cublaslt_align_rows",
        "cuda_graphs",
        "cuda_graphs_debug",
        "wgpu_gemm64",
        "wgpu_attn_bk",
        "wgpu_subgroups",
        "k_major_weights",
        "cpu_dot_products",
        "dp_stream_priority",
        "dp_bucket_bytes",
        "cuda_conv",
        "channels_last",
    ];

    /// Sets one switch by its field name. Switches on or off take 1/0, true/false or
    /// on/off; the optional ones take `default` for `None`.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), String> {
        let v = value.trim();
        let bad = |what: &str| format!("tuning {key}: expected {what}, got '{value}'");
        let flag = || match v {
            "1" | "true" | "on" => Ok(true),
            "0" | "false" | "off" => Ok(false),
            _ => Err(bad("1 or 0")),
        };
        match key {
            "cuda_attention" => self.cuda_attention = v.to_string(),
            "cuda_attention_f32" => self.cuda_attention_f32 = v.to_string(),
            "cublaslt_tune" => {
                self.cublaslt_tune = v.parse().map_err(|_| bad("a count of algorithms"))?
            }
            "cublaslt_dgelu_bgrad" => self.cublaslt_dgelu_bgrad = flag()?,
            "cublaslt_align_rows" => self.cublaslt_align_rows = flag()?,
            "cuda_graphs" => self.cuda_graphs = flag()?,
            "cuda_graphs_debug" => self.cuda_graphs_debug = flag()?,
            "wgpu_gemm64" => self.wgpu_gemm64 = flag()?,
            "wgpu_attn_bk" => {
                self.wgpu_attn_bk = match v {
                    "default" => None,
                    _ => Some(v.parse().map_err(|_| bad("a row count or default"))?),
                }
            }
            "wgpu_subgroups" => self.wgpu_subgroups = flag()?,
            "k_major_weights" => self.k_major_weights = flag()?,
            "cpu_dot_products" => self.cpu_dot_products = flag()?,
            "channels_last" => self.channels_last = flag()?,
            "cuda_conv" => {
                if !["", "columns", "cudnn", "nhwc"].contains(&v) {
                    return Err(bad("columns, cudnn, nhwc or nothing"));
                }
                self.cuda_conv = v.to_string()
            }
            "dp_stream_priority" => {
                self.dp_stream_priority = match v {
                    "default" => None,
                    _ => Some(v.parse().map_err(|_| bad("a stream priority or default"))?),
                }
            }
            "dp_bucket_bytes" => {
                self.dp_bucket_bytes = v.parse().map_err(|_| bad("a byte count"))?
            }
            _ => {
                return Err(format!(
                    "unknown tuning key '{key}'; the keys are {}",
                    Self::KEYS.join(", ")
                ))
            }
        }
        Ok(())
    }

    /// `set` from `KEY=VALUE`.
    pub fn apply(&mut self, assignment: &str) -> Result<(), String> {
        match assignment.split_once('=') {
            Some((k, v)) => self.set(k.trim(), v),
            None => Err(format!("a tuning is KEY=VALUE, got '{assignment}'")),
        }
    }
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning::DEFAULT
    }
}

static TUNING: RwLock<Tuning> = RwLock::new(Tuning::DEFAULT);

/// The process-wide tuning (a copy).
pub fn tuning() -> Tuning {
    TUNING.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Replaces the process-wide tuning. Set it before the first session: the kernel choices
/// (`cuda_attention`, `cuda_attention_f32`, `cublaslt_tune`, `cublaslt_dgelu_bgrad`,
/// `cublaslt_align_rows`,
/// `wgpu_gemm64`, `wgpu_subgroups`) are read once, when first needed; the others whenever
/// they are used.
pub fn set_tuning(t: Tuning) {
    *TUNING.write().unwrap_or_else(|e| e.into_inner()) = t;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_is_settable_and_defaults_round_trip() {
        let mut t = Tuning::default();
        for k in Tuning::KEYS {
            let v = match k {
                "cuda_attention" | "cuda_attention_f32" => "simt",
                "wgpu_attn_bk" | "dp_stream_priority" => "default",
                "cublaslt_tune" | "dp_bucket_bytes" => "6",
                "cuda_conv" => "nhwc",
                _ => "1",
            };
            t.set(k, v).unwrap_or_else(|e| panic!("{k}: {e}"));
        }
        t.apply("cuda_graphs=off").unwrap();
        assert!(!t.cuda_graphs);
        assert!(t.set("wgpu_attn_bk", "16").is_ok() && t.wgpu_attn_bk == Some(16));
        assert!(t
            .set("nope", "1")
            .unwrap_err()
            .contains("unknown tuning key"));
        assert!(t.apply("cuda_graphs").is_err());
        assert!(t.apply("cuda_conv=").is_ok() && t.cuda_conv.is_empty());
        assert!(t.set("cuda_conv", "fast").is_err());
        assert_eq!(Tuning::default(), Tuning::DEFAULT);
    }
}
