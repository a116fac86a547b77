//! `--target kv-wire`: what a peer can send the KV transport.
//!
//! - **Frames** (most cases): one to four request frames (op, region id, offset, length, little
//!   endian; a write's payload after it), with ids of a live region, a dropped one or random,
//!   ranges in bounds, at the edge, past it and overflowing, payloads short or long; a third of
//!   the cases are byte-mutated too. They go raw over TCP to a real transport's listener, which
//!   must answer or close, never hang. Unmutated cases are checked answer by answer against a
//!   model of the protocol over a shadow copy of the region: statuses, and read bytes equal to
//!   what earlier writes put there.
//! - **Descriptors**: mutated `RegionDescriptor` / `WorkerAddress` JSON, as discovery and the
//!   prefill request carry them, must parse or fail cleanly.
//! - **Plans**: random ops against random region lengths through [`plan()`]: an accepted plan
//!   stays in bounds and moves exactly the requested bytes.
//!
//! After the campaign a write and a read through the real `Transport` API still work.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use cleave_kv_transfer::{
    plan, BackendChoice, RegionDescriptor, TcpTransport, Transport, TransportConfig, WorkerAddress,
    WriteOp,
};
use rand::rngs::StdRng;
use rand::Rng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::{mutate, Cases, Tally};

/// Bytes of the region the frames address.
const REGION: usize = 64 << 10;
/// Longest a case may take before it counts as a hang.
const CASE_TIMEOUT: Duration = Duration::from_secs(10);

/// One request frame as the fuzzer means it.
struct Frame {
    op: u8,
    region: u64,
    offset: u64,
    len: u64,
    payload: Vec<u8>,
}

impl Frame {
    fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.op);
        out.extend_from_slice(&self.region.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.payload);
    }
}

fn frame(rng: &mut StdRng, live: u64, dead: u64) -> Frame {
    let op = if rng.gen_bool(0.95) {
        rng.gen_range(1..=3)
    } else {
        rng.gen()
    };
    let region = match rng.gen_range(0..10) {
        0 => dead,
        1 => rng.gen(),
        _ => live,
    };
    let (offset, len) = match rng.gen_range(0..6) {
        0 => (mutate::edge_u64(rng), mutate::edge_u64(rng)),
        1 => (REGION as u64 - 8, rng.gen_range(0..16)),
        2 => (
            rng.gen_range(0..REGION as u64),
            u64::MAX - rng.gen_range(0..4),
        ),
        _ => {
            let off = rng.gen_range(0..REGION as u64);
            (off, rng.gen_range(0..=(REGION as u64 - off).min(4096)))
        }
    };
    let payload = if op == 1 && len <= REGION as u64 {
        let mut p: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
        if rng.gen_bool(0.1) {
            p.truncate(rng.gen_range(0..=p.len()));
        }
        p
    } else {
        Vec::new()
    };
    Frame {
        op,
        region,
        offset,
        len,
        payload,
    }
}

/// The answers the protocol gives `frames` over `shadow` (updated by their writes), or `None`
/// where the connection's end is not predictable (a short payload, an unknown op, a write
/// longer than the region whose payload was not sent).
fn expected(frames: &[Frame], live: u64, shadow: &mut [u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    for f in frames {
        let known = f.region == live;
        let in_bounds = f
            .offset
            .checked_add(f.len)
            .is_some_and(|end| end <= REGION as u64);
        let status = match (known, in_bounds) {
            (false, _) => 1,
            (true, false) => 2,
            (true, true) => 0,
        };
        match f.op {
            1 => {
                if f.payload.len() as u64 != f.len {
                    return None;
                }
                if status == 0 {
                    let at = f.offset as usize;
                    shadow[at..at + f.len as usize].copy_from_slice(&f.payload);
                }
                out.push(status);
            }
            2 => {
                out.push(status);
                if status == 0 {
                    let at = f.offset as usize;
                    out.extend_from_slice(&shadow[at..at + f.len as usize]);
                }
            }
            3 => out.push(status),
            _ => return None,
        }
    }
    Some(out)
}

/// Sends `bytes` on a fresh connection, closes the sending half, and reads every answer.
async fn exchange(addr: SocketAddr, bytes: &[u8]) -> Result<Vec<u8>, String> {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        // The owner may close as soon as it sees a bad frame: a failed send is an answer too.
        let _ = s.write_all(bytes).await;
        let _ = s.shutdown().await;
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got).await;
        Ok(got)
    };
    tokio::time::timeout(CASE_TIMEOUT, fut)
        .await
        .map_err(|_| format!("no end of answers within {CASE_TIMEOUT:?}"))?
}

fn descriptor_case(rng: &mut StdRng, live: &RegionDescriptor, addr: &WorkerAddress) -> String {
    let mut text = if rng.gen_bool(0.5) {
        serde_json::to_vec(live).expect("serializable")
    } else {
        serde_json::to_vec(addr).expect("serializable")
    };
    if rng.gen_bool(0.5) {
        let mut v: serde_json::Value = serde_json::from_slice(&text).expect("json");
        mutate::json(rng, &mut v);
        text = mutate::render(&v);
    } else {
        mutate::bytes(rng, &mut text);
    }
    let d = serde_json::from_slice::<RegionDescriptor>(&text).is_ok();
    let a = serde_json::from_slice::<WorkerAddress>(&text).is_ok();
    format!("descriptor:{}", if d || a { "parsed" } else { "refused" })
}

fn plan_case(rng: &mut StdRng) -> Result<&'static str, String> {
    let local = mutate::edge_u64(rng) as usize % (1 << 20);
    let remote = if rng.gen_bool(0.1) {
        usize::MAX
    } else {
        rng.gen_range(0..1 << 20)
    };
    let ops: Vec<WriteOp> = (0..rng.gen_range(0..40))
        .map(|_| {
            let pick = |rng: &mut StdRng| {
                if rng.gen_bool(0.2) {
                    mutate::edge_u64(rng) as usize
                } else {
                    rng.gen_range(0..1 << 20)
                }
            };
            WriteOp {
                local_offset: pick(rng),
                remote_offset: pick(rng),
                len: pick(rng) % 4096,
            }
        })
        .collect();
    match plan(&ops, local, remote) {
        Err(_) => Ok("plan:refused"),
        Ok(runs) => {
            let asked: usize = ops.iter().map(|o| o.len).sum();
            let moved: usize = runs.iter().map(|r| r.len).sum();
            let inside = runs
                .iter()
                .all(|r| r.local_offset + r.len <= local && r.remote_offset + r.len <= remote);
            if asked == moved && inside {
                Ok("plan:accepted")
            } else {
                Err(format!(
                    "plan moved {moved} of {asked} bytes (in bounds: {inside}) for {ops:?}"
                ))
            }
        }
    }
}

/// The campaign.
pub fn fuzz(cases: Cases) -> anyhow::Result<Tally> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let config = TransportConfig {
            backend: BackendChoice::Tcp,
            ..Default::default()
        };
        let owner = Arc::new(TcpTransport::bind(&config)?);
        let region = owner.allocate_region(REGION)?;
        let dead = owner.allocate_region(64)?.descriptor().id.0;
        let live = region.descriptor();
        let addr = owner.listen_addr();
        let worker = owner.local_address();
        let mut shadow = region.as_slice().to_vec();
        let mut tally = Tally::new("kv-wire");
        for i in cases.range() {
            let rng = &mut cases.rng(i);
            match rng.gen_range(0..10) {
                0 => tally.ok(descriptor_case(rng, &live, &worker)),
                1 => match plan_case(rng) {
                    Ok(o) => tally.ok(o),
                    Err(e) => tally.fail(i, e),
                },
                _ => {
                    let frames: Vec<Frame> = (0..rng.gen_range(1..=4))
                        .map(|_| frame(rng, live.id.0, dead))
                        .collect();
                    let mut bytes = Vec::new();
                    frames.iter().for_each(|f| f.encode(&mut bytes));
                    let mutated = rng.gen_bool(0.33);
                    if mutated {
                        mutate::bytes(rng, &mut bytes);
                    }
                    let want = (!mutated)
                        .then(|| expected(&frames, live.id.0, &mut shadow))
                        .flatten();
                    match (exchange(addr, &bytes).await, want) {
                        (Err(e), _) => tally.fail(i, e),
                        (Ok(got), Some(want)) if got != want => tally.fail(
                            i,
                            format!(
                                "answers differ from the protocol's: got {} bytes {:?}, \
                                 want {} bytes {:?}",
                                got.len(),
                                &got[..got.len().min(16)],
                                want.len(),
                                &want[..want.len().min(16)]
                            ),
                        ),
                        (Ok(_), Some(_)) => tally.ok("frames:answered as specified"),
                        (Ok(got), None) => tally.ok(if got.is_empty() {
                            "frames:closed"
                        } else {
                            "frames:answered"
                        }),
                    }
                    // Short or mutated writes leave bytes the model cannot predict.
                    shadow.copy_from_slice(region.as_slice());
                }
            }
        }
        // The transport still serves a real peer.
        let peer = TcpTransport::bind(&config)?;
        let mut local = peer.allocate_region(4096)?;
        local.as_mut_slice().fill(0xA5);
        let op = [WriteOp {
            local_offset: 0,
            remote_offset: 1024,
            len: 4096,
        }];
        let handle = local.handle();
        let wrote = peer
            .write(&worker, &live, &op, &handle, CancellationToken::new())
            .await;
        match wrote {
            Ok(_) if region.as_slice()[1024..5120].iter().all(|&b| b == 0xA5) => {}
            Ok(_) => tally.fail_after("a write after the campaign did not land"),
            Err(e) => tally.fail_after(format!("a write after the campaign failed: {e}")),
        }
        Ok(tally)
    })
}
