//! Mooncake-format traces: one JSON object per line with the arrival `timestamp` (ms),
//! `input_length` and `output_length` (tokens) and `hash_ids` (one id per trace block, 512 tokens
//! in the published traces; equal ids = the same prefix block).

use std::io::BufRead;
use std::path::Path;

use crate::BlockHash;

/// A trace that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("cannot read trace {path}")]
    Io {
        /// The file (or the name the caller gave a reader).
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A line is not a valid request.
    #[error("trace {path} line {line}: bad request")]
    Parse {
        /// The file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// What serde_json said.
        #[source]
        source: serde_json::Error,
    },
}

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TraceRequest {
    /// Arrival, in ms from the start of the trace.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Generated tokens.
    pub output_length: u64,
    /// Prefix block ids of the prompt, one per trace block.
    pub hash_ids: Vec<u64>,
}

impl TraceRequest {
    /// The prompt's block hashes as the index sees them.
    pub fn block_hashes(&self) -> Vec<BlockHash> {
        self.hash_ids.iter().map(|&h| BlockHash(h)).collect()
    }
}

/// Parses a trace from `reader` (blank lines skipped), sorted by arrival (stable).
///
/// # Errors
/// [`TraceError::Io`] on a read error, [`TraceError::Parse`] naming the 1-based line of bad JSON.
pub fn parse_trace(reader: impl BufRead, source: &str) -> Result<Vec<TraceRequest>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.map_err(|e| TraceError::Io {
            path: source.to_owned(),
            source: e,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let req = serde_json::from_str(&line).map_err(|e| TraceError::Parse {
            path: source.to_owned(),
            line: i + 1,
            source: e,
        })?;
        out.push(req);
    }
    out.sort_by_key(|r: &TraceRequest| r.timestamp);
    Ok(out)
}

/// Reads and parses the trace at `path`.
///
/// # Errors
/// As [`parse_trace`], plus [`TraceError::Io`] if the file cannot be opened.
pub fn load_trace(path: &Path) -> Result<Vec<TraceRequest>, TraceError> {
    let name = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|e| TraceError::Io {
        path: name.clone(),
        source: e,
    })?;
    parse_trace(std::io::BufReader::new(file), &name)
}
