//! The wgpu device, shared by every backend instance of the process, and the machinery
//! the kernels use: WGSL modules and pipelines built once and cached, a per-instance
//! command encoder that collects a whole step's dispatches, a parameter arena, and
//! validation / device-lost errors turned into graphrun errors instead of panics.
//!
//! Vulkan is asked for explicitly: with default backends and no Vulkan driver wgpu picks
//! a GL adapter that is both slow and missing compute features we rely on.

use crate::error::Result;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The process-wide device: adapter, device, queue and the pipeline cache.
pub struct Gpu {
    /// The logical device.
    pub device: wgpu::Device,
    /// Its queue.
    pub queue: wgpu::Queue,
    /// The adapter's name, vendor, driver and kind.
    pub info: wgpu::AdapterInfo,
    /// Whether the adapter offers SHADER_F16 (the f16 kernels need it).
    pub f16: bool,
    /// The device's limits, as requested from the adapter.
    pub limits: wgpu::Limits,
    /// The subgroup size when the adapter offers subgroups laid out as the row reductions
    /// need (see `probe_subgroups`); `None` without them.
    pub subgroup_size: Option<u32>,
    pipelines: Mutex<HashMap<String, Arc<wgpu::ComputePipeline>>>,
    /// The first error wgpu reported outside an error scope (or the device being lost):
    /// every later call fails with it rather than running on a broken device.
    fatal: Arc<Mutex<Option<String>>>,
}

/// The shared device, made on first use; `Err` says why there is none (and is kept, so
/// a machine without an adapter answers every caller at once).
pub fn gpu() -> Result<Arc<Gpu>> {
    static GPU: OnceLock<std::result::Result<Arc<Gpu>, String>> = OnceLock::new();
    GPU.get_or_init(|| open().map(Arc::new))
        .clone()
        .map_err(|e| crate::err!(Runtime, "wgpu: {e}"))
}

/// Whether a wgpu adapter is present (`Err` names why not).
pub fn available() -> Result<()> {
    gpu().map(|_| ())
}

/// Whether the row reductions may use subgroups: `Tuning::wgpu_subgroups` (read once), or
/// switched by `set_subgroups` (tests compare both paths in-process).
static SUBGROUPS: OnceLock<std::sync::atomic::AtomicBool> = OnceLock::new();

fn subgroups_allowed() -> &'static std::sync::atomic::AtomicBool {
    SUBGROUPS.get_or_init(|| {
        std::sync::atomic::AtomicBool::new(crate::backends::tuning::tuning().wgpu_subgroups)
    })
}

/// Allows or forbids subgroup reductions for kernels launched from now on (both variants
/// are cached side by side: the choice is part of the kernel's defs).
pub fn set_subgroups(on: bool) {
    subgroups_allowed().store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Lines for `graphrun doctor`.
pub fn doctor_lines() -> Vec<String> {
    match gpu() {
        Ok(g) => vec![
            format!(
                "{} ({:?}, {:?}, driver {} {})",
                g.info.name, g.info.backend, g.info.device_type, g.info.driver, g.info.driver_info
            ),
            format!(
                "dtypes: f32{}; max storage binding {} MiB",
                if g.f16 {
                    ", f16"
                } else {
                    " (no SHADER_F16: f16 unavailable)"
                },
                g.limits.max_storage_buffer_binding_size >> 20
            ),
            match (g.subgroup_size, g.use_subgroups()) {
                (Some(n), true) => format!("subgroups: used by row reductions (size {n})"),
                (Some(n), false) => {
                    format!("subgroups: offered (size {n}), switched off (wgpu_subgroups=0)")
                }
                (None, _) => "subgroups: not used (not offered)".to_string(),
            },
        ],
        Err(e) => vec![format!("unavailable: {e}")],
    }
}

fn open() -> std::result::Result<Gpu, String> {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::VULKAN;
    let instance = wgpu::Instance::new(desc);
    let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
        power_preference: wgpu::PowerPreference::HighPerformance,
        ..Default::default()
    }))
    .map_err(|e| {
        format!("no Vulkan adapter ({e}); on Debian/Ubuntu `apt-get install mesa-vulkan-drivers libvulkan1` gives a software one")
    })?;
    let info = adapter.get_info();
    let f16 = adapter.features().contains(wgpu::Features::SHADER_F16);
    let mut features = wgpu::Features::empty();
    if f16 {
        features |= wgpu::Features::SHADER_F16;
    }
    let subgroup = adapter.features().contains(wgpu::Features::SUBGROUP);
    if subgroup {
        features |= wgpu::Features::SUBGROUP;
    }
    // The adapter's own limits: storage bindings as large as the driver allows.
    let limits = adapter.limits();
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("graphrun"),
        required_features: features,
        required_limits: limits.clone(),
        ..Default::default()
    }))
    .map_err(|e| format!("cannot open {}: {e}", info.name))?;
    let fatal = Arc::new(Mutex::new(None));
    // wgpu panics on an uncaptured error by default; we record it and fail the next call.
    let slot = fatal.clone();
    device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
        record(&slot, format!("wgpu error: {e}"));
    }));
    let slot = fatal.clone();
    device.set_device_lost_callback(move |reason, msg| {
        record(&slot, format!("wgpu device lost ({reason:?}): {msg}"));
    });
    let subgroup_size = if subgroup {
        probe_subgroups(&device, &queue)
    } else {
        None
    };
    Ok(Gpu {
        device,
        queue,
        info,
        f16,
        limits,
        subgroup_size,
        pipelines: Mutex::new(HashMap::new()),
        fatal,
    })
}

/// The subgroup size if a 256-invocation workgroup is made of full subgroups of
/// consecutive local_invocation_index (subgroup = index / size), which rows_subgroup.wgsl
/// relies on for its fixed summation order. WGSL does not promise that layout (Vulkan
/// drivers use it for compute), so it is checked once here; anything else, or any error,
/// means no subgroups.
fn probe_subgroups(device: &wgpu::Device, queue: &wgpu::Queue) -> Option<u32> {
    const SRC: &str = "@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(256)
fn probe(@builtin(local_invocation_index) lid: u32) {
    out[lid] = subgroupMin(lid);
    out[256u + lid] = subgroupAdd(1u);
}";
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("subgroup probe"),
        source: wgpu::ShaderSource::Wgsl(SRC.into()),
    });
    let pipe = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("subgroup probe"),
        layout: None,
        module: &module,
        entry_point: Some("probe"),
        compilation_options: Default::default(),
        cache: None,
    });
    let bytes = 512 * 4;
    let out = new_buffer(device, bytes);
    let staging = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("probe readback"),
        size: bytes as u64,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let bg = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipe.get_bind_group_layout(0),
        entries: &[wgpu::BindGroupEntry {
            binding: 0,
            resource: out.as_entire_binding(),
        }],
    });
    let mut enc = device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipe);
        pass.set_bind_group(0, &bg, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
    enc.copy_buffer_to_buffer(&out, 0, &staging, 0, bytes as u64);
    queue.submit([enc.finish()]);
    if pollster::block_on(scope.pop()).is_some() {
        return None;
    }
    let slice = staging.slice(..);
    let (tx, rx) = std::sync::mpsc::channel();
    slice.map_async(wgpu::MapMode::Read, move |r| {
        let _ = tx.send(r);
    });
    device
        .poll(wgpu::PollType::Wait {
            submission_index: None,
            timeout: None,
        })
        .ok()?;
    rx.recv().ok()?.ok()?;
    let words: Vec<u32> = bytemuck::cast_slice(&slice.get_mapped_range().ok()?).to_vec();
    let size = words[256];
    let laid_out = size.is_power_of_two()
        && 256 % size == 0
        && (0..256u32)
            .all(|i| words[i as usize] == i - i % size && words[256 + i as usize] == size);
    laid_out.then_some(size)
}

fn record(slot: &Mutex<Option<String>>, msg: String) {
    if let Ok(mut s) = slot.lock() {
        s.get_or_insert(msg);
    }
}

/// The WGSL sources, one per kernel family (shaders/*.wgsl).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Family {
    Elementwise,
    Matmul,
    Reduce,
    Shape,
    Attention,
    Optimizer,
}

impl Family {
    fn source(self) -> &'static str {
        match self {
            Family::Elementwise => include_str!("../../../shaders/elementwise.wgsl"),
            Family::Matmul => include_str!("../../../shaders/matmul.wgsl"),
            Family::Reduce => include_str!("../../../shaders/reduce.wgsl"),
            Family::Shape => include_str!("../../../shaders/shape.wgsl"),
            Family::Attention => include_str!("../../../shaders/attention.wgsl"),
            Family::Optimizer => include_str!("../../../shaders/optimizer.wgsl"),
        }
    }
}

/// The unary op codes, generated from src/graph/elementwise.rs (tests/opcodes.rs).
const OPCODES: &str = include_str!("../../../shaders/opcodes.wgsl");
const COMMON: &str = include_str!("../../../shaders/common.wgsl");

/// One kernel: an entry point of a family's source, specialised by `defs` (WGSL lines
/// put in front of the source: the storage type `T`, op codes, tile sizes). A pipeline
/// is built once per distinct kernel and cached for the process.
pub(crate) struct Kernel<'a> {
    pub family: Family,
    pub entry: &'a str,
    pub defs: String,
}

impl Gpu {
    /// Whether the row reductions use subgroups now (offered, laid out as needed, allowed).
    pub fn use_subgroups(&self) -> bool {
        self.subgroup_size.is_some()
            && subgroups_allowed().load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Fails with the first error wgpu reported outside a scope, if any.
    pub fn check(&self) -> Result<()> {
        match self.fatal.lock().ok().and_then(|s| s.clone()) {
            Some(e) => Err(crate::err!(Runtime, "{e}")),
            None => Ok(()),
        }
    }

    /// The cached pipeline of a kernel, built (and its WGSL validated) on first use.
    pub(crate) fn pipeline(&self, k: &Kernel) -> Result<Arc<wgpu::ComputePipeline>> {
        let key = format!("{:?}|{}|{}", k.family, k.entry, k.defs);
        let mut cache = self
            .pipelines
            .lock()
            .map_err(|_| crate::err!(Runtime, "wgpu pipeline cache poisoned"))?;
        if let Some(p) = cache.get(&key) {
            return Ok(p.clone());
        }
        let src = format!("{}\n{}\n{}\n{}", k.defs, OPCODES, COMMON, k.family.source());
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(k.entry),
                source: wgpu::ShaderSource::Wgsl(src.into()),
            });
        let p = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(k.entry),
                layout: None,
                module: &module,
                entry_point: Some(k.entry),
                compilation_options: Default::default(),
                cache: None,
            });
        if let Some(e) = pollster::block_on(scope.pop()) {
            crate::bail!(
                Runtime,
                "wgpu: kernel {:?}/{} ({}) failed to build: {e}",
                k.family,
                k.entry,
                // The specialisation lines, not the helper functions that follow them.
                k.defs
                    .lines()
                    .take_while(|l| !l.starts_with("//"))
                    .collect::<Vec<_>>()
                    .join(" ")
            );
        }
        let p = Arc::new(p);
        cache.insert(key, p.clone());
        Ok(p)
    }
}

/// Bytes of the parameter arena; a step that needs more is split into submissions.
const ARENA: u64 = 1 << 20;

/// What one backend instance records into: the pending encoder of the current step and
/// the parameter slots its dispatches read.
pub(crate) struct Recorder {
    pub gpu: Arc<Gpu>,
    encoder: Option<wgpu::CommandEncoder>,
    arena: wgpu::Buffer,
    cursor: u64,
}

impl Recorder {
    pub fn new(gpu: Arc<Gpu>) -> Recorder {
        let arena = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("params"),
            size: ARENA,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Recorder {
            gpu,
            encoder: None,
            arena,
            cursor: 0,
        }
    }

    pub fn encoder(&mut self) -> &mut wgpu::CommandEncoder {
        let dev = &self.gpu.device;
        self.encoder
            .get_or_insert_with(|| dev.create_command_encoder(&Default::default()))
    }

    /// Records one dispatch: `params` go to a fresh arena slot bound at binding 0, the
    /// buffers at the bindings given (each entry point binds exactly what it uses).
    pub fn dispatch(
        &mut self,
        k: &Kernel,
        params: &[u32],
        bufs: &[(u32, &wgpu::Buffer)],
        groups: [u32; 3],
    ) -> Result<()> {
        if groups.contains(&0) {
            return Ok(());
        }
        let max = self.gpu.limits.max_compute_workgroups_per_dimension;
        if groups.iter().any(|&g| g > max) {
            crate::bail!(
                Runtime,
                "wgpu: {} needs {groups:?} workgroups, more than the adapter's {max} per dimension",
                k.entry
            );
        }
        let pipe = self.gpu.pipeline(k)?;
        let align = self.gpu.limits.min_storage_buffer_offset_alignment as u64;
        let mut words = params.to_vec();
        words.resize(words.len().max(4), 0);
        let len = (words.len() * 4) as u64;
        if self.cursor + len > ARENA {
            self.flush()?;
        }
        let off = self.cursor;
        self.gpu
            .queue
            .write_buffer(&self.arena, off, bytemuck::cast_slice(&words));
        self.cursor = (off + len).div_ceil(align) * align;
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &self.arena,
                offset: off,
                size: wgpu::BufferSize::new(len),
            }),
        }];
        for (binding, b) in bufs {
            entries.push(wgpu::BindGroupEntry {
                binding: *binding,
                resource: b.as_entire_binding(),
            });
        }
        let bg = self
            .gpu
            .device
            .create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &pipe.get_bind_group_layout(0),
                entries: &entries,
            });
        let enc = self.encoder();
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipe);
        pass.set_bind_group(0, &bg, &[]);
        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        Ok(())
    }

    /// Submits what was recorded (one command buffer for everything since the last
    /// flush) and surfaces any validation error it raised.
    pub fn flush(&mut self) -> Result<()> {
        if let Some(enc) = self.encoder.take() {
            let scope = self
                .gpu
                .device
                .push_error_scope(wgpu::ErrorFilter::Validation);
            self.gpu.queue.submit([enc.finish()]);
            if let Some(e) = pollster::block_on(scope.pop()) {
                crate::bail!(Runtime, "wgpu: {e}");
            }
        }
        self.cursor = 0;
        self.gpu.check()
    }

    /// Flushes and waits for the device to finish.
    pub fn wait(&mut self) -> Result<()> {
        self.flush()?;
        self.gpu
            .device
            .poll(wgpu::PollType::Wait {
                submission_index: None,
                timeout: None,
            })
            .map_err(|e| crate::err!(Runtime, "wgpu: waiting for the device failed: {e}"))?;
        self.gpu.check()
    }

    /// Reads `bytes` bytes of a buffer back (flushing pending work first).
    pub fn read(&mut self, src: &wgpu::Buffer, bytes: usize) -> Result<Vec<u8>> {
        if bytes == 0 {
            return Ok(vec![]);
        }
        let size = (bytes as u64).div_ceil(4) * 4;
        let staging = self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.encoder()
            .copy_buffer_to_buffer(src, 0, &staging, 0, size);
        self.flush()?;
        let slice = staging.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv()
            .map_err(|_| crate::err!(Runtime, "wgpu: readback never completed"))?
            .map_err(|e| crate::err!(Runtime, "wgpu: readback failed: {e}"))?;
        let v = slice
            .get_mapped_range()
            .map_err(|e| crate::err!(Runtime, "wgpu: readback failed: {e}"))?[..bytes]
            .to_vec();
        staging.unmap();
        Ok(v)
    }

    /// Writes host bytes into a buffer, in order with the work recorded so far.
    pub fn write(&mut self, dst: &wgpu::Buffer, bytes: &[u8]) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        // `Queue::write_buffer` lands before the next submission's commands: recorded work
        // that reads the old contents must go first.
        self.flush()?;
        if bytes.len().is_multiple_of(4) {
            self.gpu.queue.write_buffer(dst, 0, bytes);
        } else {
            let mut padded = bytes.to_vec();
            padded.resize(bytes.len().div_ceil(4) * 4, 0);
            self.gpu.queue.write_buffer(dst, 0, &padded);
        }
        Ok(())
    }

    /// Zeroes the first `bytes` bytes of a buffer (rounded up to whole words).
    pub fn clear(&mut self, dst: &wgpu::Buffer, bytes: usize) {
        let size = (bytes as u64).div_ceil(4) * 4;
        if size > 0 {
            self.encoder()
                .clear_buffer(dst, 0, Some(size.min(dst.size())));
        }
    }

    /// Copies `bytes` bytes (rounded up to whole words, within both buffers).
    pub fn copy(&mut self, src: &wgpu::Buffer, dst: &wgpu::Buffer, bytes: usize) {
        let size = ((bytes as u64).div_ceil(4) * 4)
            .min(src.size())
            .min(dst.size());
        if size > 0 {
            self.encoder().copy_buffer_to_buffer(src, 0, dst, 0, size);
        }
    }

    pub fn buffer(&self, bytes: usize) -> wgpu::Buffer {
        new_buffer(&self.gpu.device, bytes)
    }
}

/// A storage buffer of at least `bytes` bytes, whole 4-byte words (WGSL's smallest
/// element), never empty.
pub fn new_buffer(device: &wgpu::Device, bytes: usize) -> wgpu::Buffer {
    let size = (bytes.max(4) as u64).div_ceil(16) * 16;
    device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size,
        usage: wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_SRC
            | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
}

/// Workgroups for `n` threads in groups of `wg`, spread over x and y so that large
/// tensors stay within the per-dimension limit (the kernels rebuild the linear index).
pub fn groups_for(n: usize, wg: u32) -> [u32; 3] {
    let g = n.div_ceil(wg as usize) as u64;
    if g <= 65535 {
        [g as u32, 1, 1]
    } else {
        [65535, g.div_ceil(65535) as u32, 1]
    }
}
