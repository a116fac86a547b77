//! [`Threads`]: the compute threads a matmul may use, and the shared output pointer the threads
//! write their disjoint rows through.

/// How many compute threads a matmul may use. [`Threads::single`] runs inline on the caller's
/// thread; [`Threads::new`] owns a rayon pool and splits output rows into contiguous chunks
/// (results are bit-identical to single-threaded).
#[derive(Debug)]
pub struct Threads {
    pub(super) n: usize,
    pub(super) pool: Option<rayon::ThreadPool>,
}

impl Threads {
    pub fn single() -> Self {
        Threads { n: 1, pool: None }
    }

    /// A pool of `n` threads; `n <= 1`, or a pool that fails to start, runs inline.
    pub fn new(n: usize) -> Self {
        if n <= 1 {
            return Self::single();
        }
        match rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("cleave-matmul-{i}"))
            .build()
        {
            Ok(pool) => Threads {
                n,
                pool: Some(pool),
            },
            Err(_) => Self::single(),
        }
    }

    pub fn count(&self) -> usize {
        self.n
    }

    /// Runs `f` on each job, the jobs spread over the pool (inline without one, or for a
    /// single job); returns when all are done.
    pub fn run<T: Send>(&self, jobs: Vec<T>, f: impl Fn(T) + Sync) {
        match &self.pool {
            Some(pool) if jobs.len() > 1 => pool.scope(|s| {
                let f = &f;
                for job in jobs {
                    s.spawn(move |_| f(job));
                }
            }),
            _ => jobs.into_iter().for_each(f),
        }
    }
}

impl Default for Threads {
    fn default() -> Self {
        Self::single()
    }
}

/// Output pointer shared by the threads of one matmul, each writing a disjoint set of rows.
#[derive(Clone, Copy)]
pub(super) struct OutPtr {
    pub(super) ptr: *mut f32,
    pub(super) len: usize,
}

// SAFETY: an `OutPtr` is only used during one `matmul` call, whose `&mut [f32]` borrow outlives
// all threads, and the threads write disjoint rows (`out[t * rows + r]` for their own `r`).
unsafe impl Send for OutPtr {}
// SAFETY: as above; no two threads ever write (or read) the same element.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Writes `out[i]`. Callers only write rows their chunk owns.
    pub(super) fn write(self, i: usize, v: f32) {
        assert!(i < self.len);
        // SAFETY: `i` is in bounds of the borrowed output slice, and no other thread accesses
        // element `i` (disjoint row chunks), so this write does not race.
        unsafe { self.ptr.add(i).write(v) }
    }

    /// Writes `out[i..i + N]`, as [`OutPtr::write`] does for each.
    #[inline(always)]
    pub(super) fn write_n<const N: usize>(self, i: usize, v: [f32; N]) {
        assert!(i + N <= self.len);
        // SAFETY: `i..i + N` is in bounds of the borrowed output slice, and no other thread
        // accesses these elements (disjoint row chunks), so this write does not race.
        unsafe { self.ptr.add(i).cast::<[f32; N]>().write_unaligned(v) }
    }

    /// Writes `out[i..i + 4]`, as [`OutPtr::write`] does for each.
    pub(super) fn write4(self, i: usize, v: [f32; 4]) {
        assert!(i + 4 <= self.len);
        // SAFETY: `i..i + 4` is in bounds of the borrowed output slice, and no other thread
        // accesses these elements (disjoint row chunks), so this write does not race.
        unsafe { self.ptr.add(i).cast::<[f32; 4]>().write_unaligned(v) }
    }
}
