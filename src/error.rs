//! The library's one error type. Every variant carries what a user needs to fix the
//! problem: the file and line:col for model-file errors, the node, op and value names
//! and the shapes involved for graph errors.

use std::fmt;

/// A position in a model file (1-based line and column).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Loc {
    /// The file as the loader was given it (`Model::from_str` names it `<string>`).
    pub file: String,
    /// The line, from 1.
    pub line: usize,
    /// The column, from 1.
    pub col: usize,
}

impl fmt::Display for Loc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.file, self.line, self.col)
    }
}

/// Every error the library returns. Messages are written for the user and say what to
/// fix; `is_user_error` tells the user's mistakes from failures while running.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The model file is at fault at a known place.
    #[error("{loc}: {}", clip_lists(msg))]
    Model {
        /// Where in the file.
        loc: Loc,
        /// What is wrong there.
        msg: String,
    },
    /// The graph is invalid: names the node (and op) at fault.
    #[error("{}", clip_lists(.0))]
    Graph(String),
    /// Several problems found together (e.g. every unsupported op of a model).
    #[error("{}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("\n"))]
    Many(Vec<Error>),
    /// Bad arguments or inputs given at run time (files, dims, feeds).
    #[error("{}", clip_lists(.0))]
    Input(String),
    /// A failure while running (a backend or kernel error, out of memory).
    #[error("{}", clip_lists(.0))]
    Runtime(String),
    /// A file could not be read or written.
    #[error("{path}: {}", clip_lists(msg))]
    Io {
        /// The file.
        path: String,
        /// What went wrong (the system's message).
        msg: String,
    },
}

impl Error {
    /// An `Error::Model` at `loc`.
    pub fn model(loc: &Loc, msg: impl Into<String>) -> Self {
        Error::Model {
            loc: loc.clone(),
            msg: msg.into(),
        }
    }
    /// An `Error::Io` for `path`, with `e`'s message.
    pub fn io(path: impl AsRef<std::path::Path>, e: impl fmt::Display) -> Self {
        Error::Io {
            path: path.as_ref().display().to_string(),
            msg: e.to_string(),
        }
    }
    /// True for errors caused by the model or the arguments (CLI exit code 2) rather
    /// than by running (exit code 1).
    pub fn is_user_error(&self) -> bool {
        match self {
            Error::Model { .. } | Error::Graph(_) | Error::Input(_) | Error::Io { .. } => true,
            Error::Many(v) => v.iter().all(|e| e.is_user_error()),
            Error::Runtime(_) => false,
        }
    }
}

/// The library's result type: `Error` unless said otherwise.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A message with every long `[a, b, c, ...]` list cut to its first values and a count,
/// so that an error about a million-element attribute stays one readable line.
pub fn clip_lists(msg: &str) -> std::borrow::Cow<'_, str> {
    const KEEP: usize = 8;
    if msg.len() < 200 {
        return msg.into();
    }
    let mut out = String::with_capacity(msg.len().min(4096));
    let mut rest = msg;
    while let Some(open) = rest.find('[') {
        let Some(len) = rest[open + 1..].find([']', '[']) else {
            break;
        };
        let inner = &rest[open + 1..open + 1 + len];
        out.push_str(&rest[..=open]);
        let items = inner.split(", ").count();
        if items > 2 * KEEP && rest.as_bytes()[open + 1 + len] == b']' {
            let head: Vec<&str> = inner.split(", ").take(KEEP).collect();
            out.push_str(&format!("{}, … ({items} values)", head.join(", ")));
        } else {
            out.push_str(inner);
        }
        rest = &rest[open + 1 + len..];
    }
    out.push_str(rest);
    out.into()
}

/// `bail!(Graph, "...")`-style shorthand used throughout the crate.
#[macro_export]
macro_rules! err {
    ($kind:ident, $($arg:tt)*) => { $crate::error::Error::$kind(format!($($arg)*)) };
}
/// Returns early with `err!`'s error: `bail!(Runtime, "...")`.
#[macro_export]
macro_rules! bail {
    ($kind:ident, $($arg:tt)*) => { return Err($crate::err!($kind, $($arg)*)) };
}
