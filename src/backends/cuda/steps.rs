//! What makes a CUDA step a pure sequence of launches, and its recording as a CUDA graph.
//!
//! - Scratch comes from a pool of buffers that only grows: the i-th scratch request of a
//!   node gets the i-th buffer (nodes run one after another on one stream, so buffers are
//!   reused from node to node). Once the pool has grown to a step's needs, nothing is
//!   allocated.
//! - The step number (Dropout's mask, Adam's bias correction) is a device word written
//!   before each step, so recorded launches stay valid from one step to the next.
//! - Kernels report bad input (a label or index out of range) by storing
//!   `code << 48 | value` into a word of mapped host memory; `check_error` reads it after
//!   the step's synchronisation and turns it into the registered message.
//! - A step that ran eagerly without anything unrecordable (a read-back, an allocation) is
//!   captured the next time its key comes, and replayed from then on while the key and
//!   the pool are unchanged.

use crate::error::Result;
use cudarc::driver::{sys, CudaGraph, CudaSlice, CudaStream, DevicePtr};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

/// Recorded steps kept per backend (a session alternating a few plans keeps them all).
const MAX_GRAPHS: usize = 16;

pub struct Steps {
    pool: RefCell<Vec<CudaSlice<u8>>>,
    next: Cell<usize>,
    /// Calls of `node_begins` so far: scratch taken before the last one may be handed out
    /// again.
    begun: Cell<u64>,
    /// Bumped whenever a pool buffer is replaced: recordings that hold its address die.
    epoch: Cell<u64>,
    /// Whether the current step did something a CUDA graph cannot record.
    unrecordable: Cell<bool>,
    /// [step number] on the device.
    params: CudaSlice<u64>,
    /// The bad-input word: host memory mapped into the device's address space.
    flag_host: *mut u64,
    flag_dev: u64,
    messages: RefCell<Vec<String>>,
    codes: RefCell<HashMap<String, u64>>,
    graphs: HashMap<u64, (CudaGraph, u64)>,
    order: VecDeque<u64>,
    /// The key whose last eager run was recordable: it is captured when it comes again.
    clean: Option<u64>,
    /// Keys whose capture failed: they run eagerly.
    never: HashSet<u64>,
    current: u64,
    capturing: bool,
    enabled: bool,
}

impl Drop for Steps {
    fn drop(&mut self) {
        self.graphs.clear();
        // Safety: allocated by cuMemHostAlloc in `new`, no kernel uses it any more (the
        // stream is synchronised by whoever drops the backend's buffers first).
        unsafe {
            sys::cuMemFreeHost(self.flag_host as *mut std::ffi::c_void);
        }
    }
}

fn driver_err(what: &str, e: impl std::fmt::Debug) -> crate::error::Error {
    crate::err!(Runtime, "CUDA {what} failed: {e:?}")
}

impl Steps {
    pub fn new(stream: &Arc<CudaStream>) -> Result<Steps> {
        let params = stream
            .alloc_zeros::<u64>(1)
            .map_err(|e| driver_err("allocation", e))?;
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        let mut dev: sys::CUdeviceptr = 0;
        // Safety: plain driver calls on the current context; the word is zeroed before use.
        unsafe {
            stream
                .context()
                .bind_to_thread()
                .map_err(|e| driver_err("context", e))?;
            let r = sys::cuMemHostAlloc(&mut host, 8, sys::CU_MEMHOSTALLOC_DEVICEMAP);
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(driver_err("mapped host allocation", r));
            }
            *(host as *mut u64) = 0;
            let r = sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0);
            if r != sys::CUresult::CUDA_SUCCESS {
                sys::cuMemFreeHost(host);
                return Err(driver_err("mapped host pointer", r));
            }
        }
        Ok(Steps {
            pool: RefCell::new(vec![]),
            next: Cell::new(0),
            begun: Cell::new(0),
            epoch: Cell::new(0),
            unrecordable: Cell::new(false),
            params,
            flag_host: host as *mut u64,
            flag_dev: dev,
            messages: RefCell::new(vec![]),
            codes: RefCell::new(HashMap::new()),
            graphs: HashMap::new(),
            order: VecDeque::new(),
            clean: None,
            never: HashSet::new(),
            current: 0,
            capturing: false,
            enabled: crate::backends::tuning::tuning().cuda_graphs,
        })
    }

    pub fn mark_unrecordable(&self) {
        self.unrecordable.set(true);
    }

    pub fn node_begins(&self) {
        self.next.set(0);
        self.begun.set(self.begun.get() + 1);
    }

    /// Changes whenever scratch starts over (`node_begins`): a scratch address taken
    /// under the same value still holds what was written to it.
    pub fn scratch_round(&self) -> u64 {
        self.begun.get()
    }

    pub fn scratch(&self, stream: &Arc<CudaStream>, bytes: usize) -> Result<u64> {
        let i = self.next.get();
        self.next.set(i + 1);
        let mut pool = self.pool.borrow_mut();
        if i >= pool.len() || pool[i].len() < bytes {
            // Grow with room to spare (an eighth, in whole 64 KiB), so that a slightly
            // larger request later does not reallocate (and invalidate every recording)
            // again; not to the next power of two, which left GPT-2's 823 MB padded logits
            // 201 MB a slot.
            let size = (bytes + bytes / 8).max(1 << 16).next_multiple_of(1 << 16);
            // Safety: scratch is written by its kernel before it is read.
            let buf = unsafe { stream.alloc::<u8>(size) }.map_err(|e| {
                crate::err!(
                    Runtime,
                    "CUDA out of memory allocating {size} bytes of scratch: {e:?}"
                )
            })?;
            if i < pool.len() {
                pool[i] = buf;
            } else {
                pool.push(buf);
            }
            self.unrecordable.set(true);
            self.epoch.set(self.epoch.get() + 1);
        }
        let (p, _g) = pool[i].device_ptr(stream);
        Ok(p)
    }

    /// Bytes held by the scratch pool.
    pub fn scratch_bytes(&self) -> usize {
        self.pool.borrow().iter().map(|b| b.len()).sum()
    }

    /// The device address of the step number.
    pub fn step_ptr(&self, stream: &Arc<CudaStream>) -> u64 {
        let (p, _g) = self.params.device_ptr(stream);
        p
    }

    pub fn set_step(&mut self, stream: &Arc<CudaStream>, step: u64) {
        // A failure here shows at the next synchronisation (the stream's error).
        let _ = stream.memcpy_htod(&[step], &mut self.params);
    }

    pub fn error_code(&self, msg: String) -> (u64, u64) {
        let mut codes = self.codes.borrow_mut();
        let n = codes.len() as u64 + 1;
        let code = *codes.entry(msg.clone()).or_insert_with(|| {
            self.messages.borrow_mut().push(msg);
            n
        });
        (self.flag_dev, code)
    }

    /// After a synchronisation: the first bad input a kernel reported, as an error.
    pub fn check_error(&self) -> Result<()> {
        // Safety: the word is ours; kernels that write it have finished (synchronised).
        let w = unsafe { std::ptr::read_volatile(self.flag_host) };
        if w == 0 {
            return Ok(());
        }
        // Safety: as above.
        unsafe { std::ptr::write_volatile(self.flag_host, 0) };
        let code = (w >> 48) as usize;
        let value = ((w << 16) as i64) >> 16;
        let msgs = self.messages.borrow();
        let msg = msgs
            .get(code.wrapping_sub(1))
            .map_or("a kernel reported bad input", |m| m.as_str());
        Err(crate::err!(
            Runtime,
            "{}",
            msg.replace("{v}", &value.to_string())
        ))
    }

    /// Starts a step; true when it was replayed from a recording (its launches must not be
    /// issued again).
    pub fn begin(&mut self, stream: &Arc<CudaStream>, key: u64) -> Result<bool> {
        self.unrecordable.set(false);
        self.current = key;
        if !self.enabled {
            return Ok(false);
        }
        if let Some((g, epoch)) = self.graphs.get(&key) {
            if *epoch == self.epoch.get() {
                g.launch().map_err(|e| driver_err("graph launch", e))?;
                return Ok(true);
            }
            self.graphs.remove(&key);
        }
        if self.clean == Some(key) && !self.never.contains(&key) {
            stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| driver_err("stream capture", e))?;
            self.capturing = true;
        }
        Ok(false)
    }

    /// Ends a step whose launches were issued (`ok`: all of them succeeded). True when
    /// they were only recorded, and the recording failed: issue them again.
    pub fn end(&mut self, stream: &Arc<CudaStream>, ok: bool) -> Result<bool> {
        let key = self.current;
        let recordable = ok && !self.unrecordable.get();
        if !self.capturing {
            self.clean = if recordable { Some(key) } else { None };
            return Ok(false);
        }
        self.capturing = false;
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        match (recordable, graph) {
            (true, Ok(Some(g))) => {
                g.launch().map_err(|e| driver_err("graph launch", e))?;
                if self.graphs.len() >= MAX_GRAPHS {
                    if let Some(old) = self.order.pop_front() {
                        self.graphs.remove(&old);
                    }
                }
                self.order.retain(|&k| k != key);
                self.order.push_back(key);
                self.graphs.insert(key, (g, self.epoch.get()));
                Ok(false)
            }
            (recordable, graph) => {
                if crate::backends::tuning::tuning().cuda_graphs_debug {
                    eprintln!(
                        "graphrun: step not recorded (launches ok: {recordable}): {:?}",
                        graph.map(|g| g.is_some())
                    );
                }
                self.never.insert(key);
                self.clean = None;
                Ok(true)
            }
        }
    }
}
