//! The TCP frames: a fixed 25-byte request header (op, region id, offset, length; little
//! endian) followed by the payload for writes; a one-byte status answer, followed by the
//! payload for successful reads.

use crate::RegionId;

pub(super) const HEADER_LEN: usize = 25;

/// What a request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Op {
    /// Copy the payload that follows into the region.
    Write = 1,
    /// Send back the region's bytes.
    Read = 2,
    /// Answer whether the region exists.
    Ping = 3,
}

/// A request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Header {
    pub op: Op,
    pub region: RegionId,
    pub offset: u64,
    pub len: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = self.op as u8;
        b[1..9].copy_from_slice(&self.region.0.to_le_bytes());
        b[9..17].copy_from_slice(&self.offset.to_le_bytes());
        b[17..25].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; HEADER_LEN]) -> Option<Header> {
        let op = match b[0] {
            1 => Op::Write,
            2 => Op::Read,
            3 => Op::Ping,
            _ => return None,
        };
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Some(Header {
            op,
            region: RegionId(word(1)),
            offset: word(9),
            len: word(17),
        })
    }
}

/// The answer to one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Status {
    Ok = 0,
    UnknownRegion = 1,
    OutOfBounds = 2,
}

impl Status {
    pub fn decode(b: u8) -> Option<Status> {
        match b {
            0 => Some(Status::Ok),
            1 => Some(Status::UnknownRegion),
            2 => Some(Status::OutOfBounds),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = Header {
            op: Op::Read,
            region: RegionId(0xdead_beef_0000_0001),
            offset: 7,
            len: u64::MAX,
        };
        assert_eq!(Header::decode(&h.encode()), Some(h));
        let mut bad = h.encode();
        bad[0] = 9;
        assert_eq!(Header::decode(&bad), None);
    }
}
