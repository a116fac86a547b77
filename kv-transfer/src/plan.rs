//! First hop of a transfer: validate the caller's ops against both regions and coalesce runs
//! that are contiguous on both sides into one operation, so a 128-block prompt whose blocks sit
//! next to each other goes out as one put instead of 128.

use crate::{Error, Side, WriteOp};

/// One operation to issue: a coalesced run of ops.
pub type Run = WriteOp;

/// Checks every op against the local and remote region lengths and merges ops that continue
/// the previous one on both sides. Order is preserved; zero-length ops are dropped.
pub fn plan(ops: &[WriteOp], local_len: usize, remote_len: usize) -> Result<Vec<Run>, Error> {
    let mut runs: Vec<Run> = Vec::with_capacity(ops.len().min(64));
    for op in ops {
        check(Side::Local, op.local_offset, op.len, local_len)?;
        check(Side::Remote, op.remote_offset, op.len, remote_len)?;
        if op.len == 0 {
            continue;
        }
        match runs.last_mut() {
            Some(last)
                if last.local_offset + last.len == op.local_offset
                    && last.remote_offset + last.len == op.remote_offset =>
            {
                last.len += op.len;
            }
            _ => runs.push(*op),
        }
    }
    Ok(runs)
}

fn check(side: Side, offset: usize, len: usize, region_len: usize) -> Result<(), Error> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(Error::OutOfBounds {
            side,
            offset,
            len,
            region_len,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(local_offset: usize, remote_offset: usize, len: usize) -> WriteOp {
        WriteOp {
            local_offset,
            remote_offset,
            len,
        }
    }

    #[test]
    fn contiguous_ops_merge_into_one_run() {
        let ops: Vec<_> = (0..16).map(|i| op(i * 10, 100 + i * 10, 10)).collect();
        assert_eq!(plan(&ops, 1000, 1000).unwrap(), vec![op(0, 100, 160)]);
    }

    #[test]
    fn ops_contiguous_on_one_side_only_stay_apart() {
        // Local contiguous, remote not; then remote contiguous, local not.
        let ops = [op(0, 0, 10), op(10, 20, 10), op(40, 30, 10)];
        assert_eq!(plan(&ops, 100, 100).unwrap(), ops.to_vec());
    }

    #[test]
    fn scattered_runs_merge_piecewise_and_keep_order() {
        let ops = [
            op(0, 50, 5),
            op(5, 55, 5),
            op(90, 0, 5),
            op(95, 5, 5),
            op(20, 20, 1),
        ];
        assert_eq!(
            plan(&ops, 100, 100).unwrap(),
            vec![op(0, 50, 10), op(90, 0, 10), op(20, 20, 1)]
        );
    }

    #[test]
    fn zero_length_ops_are_dropped_but_still_checked() {
        assert_eq!(plan(&[op(3, 3, 0)], 10, 10).unwrap(), vec![]);
        assert!(plan(&[op(11, 0, 0)], 10, 10).is_err());
    }

    #[test]
    fn out_of_bounds_names_the_side() {
        let err = plan(&[op(0, 95, 10)], 100, 100).unwrap_err();
        assert!(matches!(
            err,
            Error::OutOfBounds {
                side: Side::Remote,
                offset: 95,
                len: 10,
                region_len: 100
            }
        ));
        let err = plan(&[op(usize::MAX, 0, 2)], 100, 100).unwrap_err();
        assert!(matches!(
            err,
            Error::OutOfBounds {
                side: Side::Local,
                ..
            }
        ));
        assert_eq!(
            plan(&[op(0, 95, 10)], 100, 100).unwrap_err().to_string(),
            "remote range 95..105 is outside the remote region of 100 bytes"
        );
    }
}
