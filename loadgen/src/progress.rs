//! A one-line progress bar on stderr (`[#####-----] 12/40 label`), redrawn in place; silent
//! when disabled.

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Counts finished requests of a load point and redraws the bar.
#[derive(Debug)]
pub struct Progress {
    total: usize,
    done: AtomicUsize,
    label: String,
    enabled: bool,
}

impl Progress {
    /// A bar for `total` requests.
    pub fn new(total: usize, label: String, enabled: bool) -> Self {
        let p = Progress {
            total,
            done: AtomicUsize::new(0),
            label,
            enabled,
        };
        p.draw(0);
        p
    }

    /// One more request finished.
    pub fn tick(&self) {
        let n = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        self.draw(n);
    }

    /// Ends the line.
    pub fn finish(&self) {
        if self.enabled {
            eprintln!();
        }
    }

    fn draw(&self, n: usize) {
        if !self.enabled {
            return;
        }
        const W: usize = 30;
        let filled = (n * W).checked_div(self.total).unwrap_or(W).min(W);
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r[{}{}] {n}/{} {}",
            "#".repeat(filled),
            "-".repeat(W - filled),
            self.total,
            self.label
        );
        let _ = err.flush();
    }
}
