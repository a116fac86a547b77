//! Worker groups: the leader rank runs the scheduler and broadcasts every step's batch; the
//! other ranks ([`run_follower`]) receive it and run the same forward pass on their own shard
//! and their own KV cache, with the same block ids. The collectives inside the forward pass
//! keep the ranks in lockstep; only the leader samples.
//!
//! Messages (little-endian), broadcast from rank 0:
//! - `0`: stop (the leader is shutting down);
//! - `1`: heartbeat (the leader is idle; every rank answers with a barrier, so a dead rank is
//!   noticed while no request runs);
//! - `2`: a step: `u32` chunk count, then per chunk `u8` logits (0 none, 1 last, 2 all),
//!   `u32` start position, `u32` token count, the tokens, `u32` block count, the block ids
//!   (only the blocks the chunk reaches);
//! - `3`: a relay: `u8` reply flag, then an opaque payload for the follower's relay handler
//!   (the worker uses it to have each rank write its own KV heads to a peer); with the flag
//!   set every rank then joins an all-reduce of the handler's status (0 = ok), so the leader
//!   learns whether every follower succeeded.

use std::time::Duration;

use crate::kv::memory::KvCache;
use crate::kv::BlockId;
use crate::model::{Logits, Model, SeqChunk, Workspace};
use cleave_types::collective::{Collective, CollectiveError};

const STOP: u8 = 0;
const HEARTBEAT: u8 = 1;
const STEP: u8 = 2;
const RELAY: u8 = 3;

/// How the leader keeps its group in lockstep.
#[derive(Clone)]
pub struct GroupLink {
    /// The group (this process is rank 0).
    pub collective: std::sync::Arc<dyn Collective>,
    /// How often an idle leader checks that every rank is alive.
    pub heartbeat: Duration,
}

/// Why a follower stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum FollowerError {
    /// A collective failed (a rank died, timed out, or the group was aborted).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// The leader sent a message this follower cannot decode.
    #[error("bad step message from the leader: {0}")]
    BadMessage(String),
}

/// A decoded message.
#[derive(Debug, PartialEq, Eq)]
pub enum StepMessage {
    /// The leader stops; so does the follower.
    Stop,
    /// Answer with a barrier.
    Heartbeat,
    /// Run this batch.
    Step(Vec<OwnedChunk>),
    /// Hand the payload to the relay handler; with `reply`, all-reduce its status.
    Relay {
        /// Whether the leader waits for every rank's status.
        reply: bool,
        /// Opaque to the engine.
        payload: Vec<u8>,
    },
}

/// A [`SeqChunk`] with owned buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnedChunk {
    /// The tokens.
    pub tokens: Vec<u32>,
    /// Position of the first token.
    pub start_pos: usize,
    /// The block table (at least the blocks the chunk reaches).
    pub blocks: Vec<BlockId>,
    /// Which logits the forward pass computes.
    pub logits: Logits,
}

/// Encodes a step's batch; `block_size` trims each block table to the blocks the chunk reaches.
pub fn encode_step(chunks: &[SeqChunk], block_size: usize, out: &mut Vec<u8>) {
    out.clear();
    out.push(STEP);
    put(out, chunks.len());
    for c in chunks {
        out.push(match c.logits {
            Logits::None => 0,
            Logits::Last => 1,
            Logits::All => 2,
        });
        put(out, c.start_pos);
        put(out, c.tokens.len());
        for &t in c.tokens {
            out.extend_from_slice(&t.to_le_bytes());
        }
        let reach = (c.start_pos + c.tokens.len())
            .div_ceil(block_size.max(1))
            .min(c.blocks.len());
        put(out, reach);
        for b in &c.blocks[..reach] {
            out.extend_from_slice(&b.0.to_le_bytes());
        }
    }
}

fn put(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&(n as u32).to_le_bytes());
}

/// A one-byte control message.
pub fn encode_control(stop: bool, out: &mut Vec<u8>) {
    out.clear();
    out.push(if stop { STOP } else { HEARTBEAT });
}

/// A relay message (kind 3) carrying `payload`.
pub fn encode_relay(payload: &[u8], reply: bool, out: &mut Vec<u8>) {
    out.clear();
    out.push(RELAY);
    out.push(u8::from(reply));
    out.extend_from_slice(payload);
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl Reader<'_> {
    fn u8(&mut self) -> Result<u8, FollowerError> {
        let (&b, rest) = self
            .buf
            .split_first()
            .ok_or_else(|| FollowerError::BadMessage("truncated".into()))?;
        self.buf = rest;
        Ok(b)
    }
    fn u32(&mut self) -> Result<u32, FollowerError> {
        if self.buf.len() < 4 {
            return Err(FollowerError::BadMessage("truncated".into()));
        }
        let (head, rest) = self.buf.split_at(4);
        self.buf = rest;
        Ok(u32::from_le_bytes(head.try_into().expect("4 bytes")))
    }
    fn u32s(&mut self) -> Result<Vec<u32>, FollowerError> {
        let n = self.u32()? as usize;
        if self.buf.len() < n.saturating_mul(4) {
            return Err(FollowerError::BadMessage(format!(
                "{n} entries announced, {} bytes left",
                self.buf.len()
            )));
        }
        (0..n).map(|_| self.u32()).collect()
    }
}

/// Decodes a message from the leader.
pub fn decode(buf: &[u8]) -> Result<StepMessage, FollowerError> {
    let mut r = Reader { buf };
    let msg = match r.u8()? {
        STOP => StepMessage::Stop,
        HEARTBEAT => StepMessage::Heartbeat,
        STEP => {
            let n = r.u32()? as usize;
            let mut chunks = Vec::with_capacity(n.min(4096));
            for _ in 0..n {
                let logits = match r.u8()? {
                    0 => Logits::None,
                    1 => Logits::Last,
                    2 => Logits::All,
                    other => return Err(FollowerError::BadMessage(format!("logits kind {other}"))),
                };
                let start_pos = r.u32()? as usize;
                let tokens = r.u32s()?;
                let blocks = r.u32s()?.into_iter().map(BlockId).collect();
                chunks.push(OwnedChunk {
                    tokens,
                    start_pos,
                    blocks,
                    logits,
                });
            }
            StepMessage::Step(chunks)
        }
        RELAY => {
            let reply = r.u8()? != 0;
            let payload = std::mem::take(&mut r.buf).to_vec();
            StepMessage::Relay { reply, payload }
        }
        other => return Err(FollowerError::BadMessage(format!("message kind {other}"))),
    };
    if !r.buf.is_empty() {
        return Err(FollowerError::BadMessage(format!(
            "{} trailing bytes",
            r.buf.len()
        )));
    }
    Ok(msg)
}

/// Checks a step against this rank's model and cache, so a bad message is an error rather than
/// a panic inside the forward pass.
fn validate(chunks: &[OwnedChunk], model: &Model, cache: &KvCache) -> Result<(), FollowerError> {
    let bs = cache.layout().block_size;
    for c in chunks {
        if let Some(&t) = c.tokens.iter().find(|&&t| t as usize >= model.config.vocab) {
            return Err(FollowerError::BadMessage(format!(
                "token {t} out of vocabulary"
            )));
        }
        if let Some(b) = c.blocks.iter().find(|b| b.0 as usize >= cache.num_blocks()) {
            return Err(FollowerError::BadMessage(format!(
                "block {} out of a pool of {}",
                b.0,
                cache.num_blocks()
            )));
        }
        if c.tokens.is_empty() || c.blocks.len() * bs < c.start_pos + c.tokens.len() {
            return Err(FollowerError::BadMessage(
                "a chunk's block table does not cover its tokens".into(),
            ));
        }
    }
    Ok(())
}

/// Runs a follower rank until the leader stops it (`Ok`) or the group fails (`Err`). Returns the
/// number of steps run. Relay messages are answered with a failure status (no handler).
pub fn run_follower(
    model: &Model,
    cache: &mut KvCache,
    group: &dyn Collective,
) -> Result<u64, FollowerError> {
    run_follower_with(model, cache, group, &mut |_: &[u8]| 1.0)
}

/// [`run_follower`] with a handler for relay messages: it gets the payload and returns this
/// rank's status (0 = ok), which is summed over the ranks when the leader asked for a reply.
pub fn run_follower_with(
    model: &Model,
    cache: &mut KvCache,
    group: &dyn Collective,
    on_relay: &mut dyn FnMut(&[u8]) -> f32,
) -> Result<u64, FollowerError> {
    if group.rank() == 0 {
        return Err(FollowerError::BadMessage(
            "rank 0 is the leader, not a follower".into(),
        ));
    }
    let mut ws = Workspace::new();
    let mut buf = Vec::new();
    let mut steps = 0;
    loop {
        buf.clear();
        group.broadcast(0, &mut buf)?;
        match decode(&buf)? {
            StepMessage::Stop => return Ok(steps),
            StepMessage::Heartbeat => group.barrier()?,
            StepMessage::Relay { reply, payload } => {
                let mut status = [on_relay(&payload)];
                if reply {
                    group.all_reduce_sum(&mut status)?;
                }
            }
            StepMessage::Step(chunks) => {
                validate(&chunks, model, cache)?;
                let seq: Vec<SeqChunk> = chunks
                    .iter()
                    .map(|c| SeqChunk {
                        tokens: &c.tokens,
                        start_pos: c.start_pos,
                        blocks: &c.blocks,
                        logits: c.logits,
                    })
                    .collect();
                model.forward(&seq, cache, &mut ws)?;
                steps += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_messages_round_trip_and_trim_block_tables() {
        let blocks: Vec<BlockId> = (10..20).map(BlockId).collect();
        let chunks = [
            SeqChunk {
                tokens: &[1, 2, 3],
                start_pos: 16,
                blocks: &blocks,
                logits: Logits::Last,
            },
            SeqChunk {
                tokens: &[7],
                start_pos: 0,
                blocks: &blocks[..1],
                logits: Logits::None,
            },
        ];
        let mut buf = Vec::new();
        encode_step(&chunks, 16, &mut buf);
        let StepMessage::Step(got) = decode(&buf).unwrap() else {
            panic!("not a step")
        };
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].tokens, vec![1, 2, 3]);
        assert_eq!(got[0].start_pos, 16);
        assert_eq!(got[0].blocks, vec![BlockId(10), BlockId(11)]);
        assert_eq!(got[0].logits, Logits::Last);
        assert_eq!(got[1].blocks, vec![BlockId(10)]);
        encode_control(true, &mut buf);
        assert_eq!(decode(&buf).unwrap(), StepMessage::Stop);
        encode_control(false, &mut buf);
        assert_eq!(decode(&buf).unwrap(), StepMessage::Heartbeat);
        encode_relay(b"xyz", true, &mut buf);
        assert_eq!(
            decode(&buf).unwrap(),
            StepMessage::Relay {
                reply: true,
                payload: b"xyz".to_vec()
            }
        );
    }

    #[test]
    fn malformed_messages_are_errors() {
        for bad in [
            &[][..],
            &[9],
            &[2, 5, 0, 0, 0],
            &[2, 0, 0, 0, 0, 1],
            &[2, 1, 0, 0, 0, 7],
        ] {
            assert!(
                matches!(decode(bad), Err(FollowerError::BadMessage(_))),
                "{bad:?}"
            );
        }
        // A huge announced length with no data is an error, not a huge allocation.
        assert!(decode(&[2, 1, 0, 0, 0, 1, 0, 0, 0, 0, 255, 255, 255, 255]).is_err());
    }
}
