//! The one error type of the crate: every argument problem is found before anything is written.

use std::fmt;

/// A refused call. Nothing was read out of bounds and nothing was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CpuError {
    /// An array's length or a size disagrees with the shape the call implies.
    Shape(String),
    /// A block-table entry a call would read is not a block of the cache.
    BlockId {
        row: usize,
        entry: usize,
        value: i64,
        num_blocks: usize,
    },
    /// A slot, copy or swap index outside its range, or one named twice.
    Index(String),
    /// Any other argument out of its domain (a length, a scale, a window).
    Argument(String),
}

impl fmt::Display for CpuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CpuError::Shape(m) | CpuError::Index(m) | CpuError::Argument(m) => f.write_str(m),
            CpuError::BlockId {
                row,
                entry,
                value,
                num_blocks,
            } => write!(
                f,
                "block table row {row} entry {entry} is {value}, not a block id in [0, {num_blocks})"
            ),
        }
    }
}

impl std::error::Error for CpuError {}

pub type Result<T> = std::result::Result<T, CpuError>;
