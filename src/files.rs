//! Every file graphrun reads or writes goes through here, below the IR, so the loaders,
//! the executor and the command line share one set of rules:
//!
//! - **Reading** (`open`, `read_bytes`): the size is checked against the memory cap before
//!   anything is read, reads are bounded (a pipe or `/dev/zero` cannot run memory out), and
//!   buffers are reserved fallibly. With `guard_inputs` on (the command line turns it on:
//!   one process is one run), every file read is remembered so that no output of the same
//!   run replaces it.
//! - **Paths a model names** (`resolve_inside`): external data and initializer files must
//!   resolve, symlinks followed, inside the model's folder unless the user opted out.
//! - **Writing** (`check_output`, `Outputs`, `write_atomic`): every output path is checked
//!   before any work; bytes go to a temporary file created exclusively (never through a
//!   planted symlink) beside the target and are renamed over it only once every output of
//!   the run is complete, so a failed run leaves nothing behind.

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Mutex;

/// Longest file name most file systems take (NAME_MAX on Linux, macOS and Windows).
const NAME_MAX: usize = 255;

// ---- reading ------------------------------------------------------------------------

/// Files this process has read, by real path, with what they were read as.
fn read_files() -> &'static Mutex<HashMap<PathBuf, String>> {
    static READ: std::sync::OnceLock<Mutex<HashMap<PathBuf, String>>> = std::sync::OnceLock::new();
    READ.get_or_init(Default::default)
}

static GUARD_INPUTS: AtomicBool = AtomicBool::new(false);

/// Refuse, from now on, to write any output over a file this process has read (and
/// start remembering them). For a process that is one run, as the command line is; a
/// library that loads and later saves the same file leaves it off.
pub fn guard_inputs(on: bool) {
    GUARD_INPUTS.store(on, Relaxed);
}

fn remember_read(path: &Path, what: &str) {
    if !GUARD_INPUTS.load(Relaxed) {
        return;
    }
    if let Ok(real) = std::fs::canonicalize(path) {
        let mut m = read_files().lock().unwrap_or_else(|e| e.into_inner());
        m.entry(real).or_insert_with(|| what.to_string());
    }
}

/// Opens `path` for reading; `what` names it in errors ("input 'x'"). Returns the file
/// and its length (`None` for pipes and devices, whose reads must be bounded instead).
pub fn open(path: &Path, what: &str) -> Result<(File, Option<u64>)> {
    let f = File::open(path).map_err(|e| Error::io(path, e))?;
    let meta = f.metadata().map_err(|e| Error::io(path, e))?;
    if meta.is_dir() {
        return Err(Error::io(path, format!("{what} is a folder, not a file")));
    }
    remember_read(path, what);
    Ok((f, meta.is_file().then_some(meta.len())))
}

/// A buffer of `n` bytes reserved without aborting when memory is short, and within the
/// memory cap (`what` names it in the error).
pub fn try_buffer(n: usize, what: &str) -> Result<Vec<u8>> {
    let cap = crate::tensor::max_bytes();
    if n > cap {
        crate::bail!(
            Input,
            "{what} needs {n} bytes, over the memory limit of {cap} bytes (raise it with GRAPHRUN_MAX_BYTES, or --max-memory on the command line)"
        );
    }
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        crate::err!(
            Runtime,
            "out of memory: cannot allocate {n} bytes for {what}"
        )
    })?;
    Ok(v)
}

/// The whole of a file, refused before reading when it is over the memory cap.
pub fn read_bytes(path: &Path, what: &str) -> Result<Vec<u8>> {
    let (f, len) = open(path, what)?;
    let cap = crate::tensor::max_bytes();
    let len = len.map_or(0, |l| usize::try_from(l).unwrap_or(usize::MAX));
    let mut buf = try_buffer(len, &format!("{what} ({})", path.display()))?;
    // Bounded by the cap: a file that grows, a pipe or a device stops there.
    f.take(cap as u64 + 1)
        .read_to_end(&mut buf)
        .map_err(|e| Error::io(path, e))?;
    if buf.len() > cap {
        return Err(Error::io(
            path,
            format!(
                "{what} is larger than the memory limit of {cap} bytes (raise it with GRAPHRUN_MAX_BYTES, or --max-memory on the command line)"
            ),
        ));
    }
    Ok(buf)
}

static ALLOW_OUTSIDE: AtomicBool = AtomicBool::new(false);

/// Lets models name data files outside their own folder (absolute paths, `..`, symlinks
/// that lead elsewhere): for users who keep weights in a separate place. Off by default.
pub fn set_allow_outside(allow: bool) {
    ALLOW_OUTSIDE.store(allow, Relaxed);
}

/// The file `rel` names, relative to the model's folder `base`. Unless
/// `set_allow_outside(true)` was called, it must be a relative path whose real location
/// (symlinks resolved) lies inside `base`'s real location.
pub fn resolve_inside(base: &Path, rel: &Path) -> std::result::Result<PathBuf, String> {
    let path = base.join(rel);
    if ALLOW_OUTSIDE.load(Relaxed) {
        return Ok(path);
    }
    let outside = || {
        format!(
            "'{}' lies outside the model's folder; models may only name files inside it (files::set_allow_outside, or --allow-outside-files on the command line, permits it)",
            rel.display()
        )
    };
    if rel
        .components()
        .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
    {
        return Err(outside());
    }
    let dir = if base.as_os_str().is_empty() {
        Path::new(".")
    } else {
        base
    };
    let real_base = std::fs::canonicalize(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let real = std::fs::canonicalize(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    if !real.starts_with(&real_base) {
        return Err(format!("{} (it resolves to {})", outside(), real.display()));
    }
    Ok(path)
}

// ---- writing ------------------------------------------------------------------------

/// The folder `path` goes in ("." for a bare name).
fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Checks, before any work, that `path` can be written as an output: a legal file name, in
/// an existing folder, not a folder itself, and not a file this run reads. `Outputs`
/// repeats the check when it writes.
pub fn check_output(path: &Path) -> Result<()> {
    let Some(name) = path.file_name() else {
        return Err(Error::io(path, "an output must name a file"));
    };
    if name.len() > NAME_MAX {
        return Err(Error::io(
            path,
            format!(
                "the file name is {} bytes long; file systems take at most {NAME_MAX}",
                name.len()
            ),
        ));
    }
    let dir = parent_of(path);
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(Error::io(
                path,
                format!("{} is not a folder", dir.display()),
            ))
        }
        Err(_) => {
            return Err(Error::io(
                path,
                format!("the folder {} does not exist", dir.display()),
            ))
        }
    }
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if m.is_dir() {
            return Err(Error::io(path, "is a folder; an output must be a file"));
        }
    }
    // What the rename would replace: the real file (a symlink's target is never written,
    // but refusing it too keeps the rule simple to state).
    let real_dir = std::fs::canonicalize(dir).map_err(|e| Error::io(dir, e))?;
    let replaced = [Some(real_dir.join(name)), std::fs::canonicalize(path).ok()];
    let read = read_files().lock().unwrap_or_else(|e| e.into_inner());
    for p in replaced.iter().flatten() {
        if let Some(what) = read.get(p) {
            return Err(Error::io(
                path,
                format!(
                    "refusing to replace {}, which this run reads as {what}; write the output elsewhere",
                    p.display()
                ),
            ));
        }
    }
    Ok(())
}

/// Checks, before any work, that `dir` can hold outputs: a folder, or a path whose
/// nearest existing ancestor is a folder (`Outputs::create_dir` makes the rest).
pub fn check_output_dir(dir: &Path) -> Result<()> {
    let mut p = dir;
    loop {
        match std::fs::metadata(p) {
            Ok(m) if m.is_dir() => return Ok(()),
            Ok(_) if p == dir => return Err(Error::io(dir, "is a file, not a folder")),
            Ok(_) => {
                return Err(Error::io(
                    dir,
                    format!("cannot be made: {} is a file", p.display()),
                ))
            }
            Err(_) => match p.parent() {
                Some(up) if !up.as_os_str().is_empty() => p = up,
                _ => return Ok(()),
            },
        }
    }
}

/// Checks `name` as the name of a file to be written in a folder that may not exist yet.
pub fn check_output_name(dir: &Path, name: &str) -> Result<()> {
    let path = dir.join(name);
    if name.len() > NAME_MAX {
        return Err(Error::io(
            &path,
            format!(
                "the file name is {} bytes long; file systems take at most {NAME_MAX}",
                name.len()
            ),
        ));
    }
    if dir.is_dir() {
        check_output(&path)?;
    }
    Ok(())
}

/// A set of outputs written all or nothing: each is staged in a temporary file beside
/// its target, and `commit` renames them into place. Dropped without `commit` (an error
/// on the way), every staged file and every folder it made is removed.
#[derive(Default)]
pub struct Outputs {
    staged: Vec<(tempfile::NamedTempFile, PathBuf)>,
    made_dirs: Vec<PathBuf>,
}

impl Drop for Outputs {
    fn drop(&mut self) {
        self.staged.clear();
        for d in self.made_dirs.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

impl Outputs {
    /// An empty set.
    pub fn new() -> Outputs {
        Outputs::default()
    }

    /// Makes `dir` and its missing ancestors (removed again if the outputs are dropped
    /// uncommitted).
    pub fn create_dir(&mut self, dir: &Path) -> Result<()> {
        let mut missing = vec![];
        let mut p = dir;
        while !p.as_os_str().is_empty() && std::fs::symlink_metadata(p).is_err() {
            missing.push(p.to_path_buf());
            p = p.parent().unwrap_or(Path::new(""));
        }
        for d in missing.into_iter().rev() {
            std::fs::create_dir(&d).map_err(|e| Error::io(&d, e))?;
            self.made_dirs.push(d);
        }
        if !dir.is_dir() {
            return Err(Error::io(dir, "is not a folder"));
        }
        Ok(())
    }

    /// Writes one output's bytes to a temporary file beside `path`.
    pub fn stage(
        &mut self,
        path: &Path,
        write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
    ) -> Result<()> {
        check_output(path)?;
        // A short random name (".gr" + 6 characters), created with O_EXCL so that nothing
        // planted under it is followed, and with the permissions of an ordinary new file
        // (0666 less the umask), not tempfile's owner-only default.
        let mut tmp = tempfile::Builder::new()
            .prefix(".gr")
            .rand_bytes(6)
            .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666))
            .tempfile_in(parent_of(path))
            .map_err(|e| Error::io(path, e))?;
        let mut w = std::io::BufWriter::new(tmp.as_file_mut());
        write(&mut w)
            .and_then(|_| w.flush())
            .map_err(|e| Error::io(path, e))?;
        drop(w);
        self.staged.push((tmp, path.to_path_buf()));
        Ok(())
    }

    /// Renames every staged file into place.
    pub fn commit(mut self) -> Result<()> {
        for (tmp, path) in std::mem::take(&mut self.staged) {
            tmp.persist(&path).map_err(|e| Error::io(&path, e.error))?;
        }
        self.made_dirs.clear();
        Ok(())
    }
}

/// Writes one file whole or not at all (an `Outputs` of one).
pub fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<()> {
    let mut out = Outputs::new();
    out.stage(path, write)?;
    out.commit()
}
