//! `--target grpc`: the messages workers accept, sent raw to real workers.
//!
//! A decode worker and a prefill worker serve a tiny random-weight llama (written to a
//! temporary directory; TCP KV transport, all on loopback). Each case is a `Generate` (to the
//! decode worker) or a `Prefill` (to the prefill worker) with generated fields (prompts empty,
//! past the context, with ids outside the vocabulary; sampling parameters at their edges,
//! NaN included; stop strings; constraints with broken schemas, regexes and grammars; resumed
//! tokens; KV destinations naming the decode worker's real region with wrong blocks, sizes and
//! descriptors), and a third of them are byte-mutated after encoding. The bytes go out through a
//! pass-through codec, so the server's own decoder sees them.
//!
//! Every address a message could make a worker dial is kept on loopback: a decodable mutant
//! that names another host is rewritten before it is sent.
//!
//! A case fails on a hang, a stream that ends without `Finished`, a status `UNKNOWN`, or
//! `INTERNAL` for a message that decodes (tonic answers `INTERNAL` to bytes that do not). After
//! the campaign both workers must be healthy and hold no sequence and no KV block in use.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use cleave_decode_worker::SERVICE as DECODE;
use cleave_kv_transfer::BackendChoice;
use cleave_prefill_worker::SERVICE as PREFILL;
use cleave_proto::v1 as pb;
use cleave_text::tiny;
use cleave_worker::convert::kv;
use cleave_worker::{run, Running, WorkerConfig};
use prost::bytes::{Buf, BufMut};
use prost::Message;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;
use tokio_util::sync::CancellationToken;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;
use tonic::Code;

use super::{mutate, Cases, Tally};

/// Longest a case may take before it counts as a hang.
const CASE_TIMEOUT: Duration = Duration::from_secs(30);
/// A port nothing listens on (connections are refused).
const REFUSED: &str = "http://127.0.0.1:1";

/// Bytes in, bytes out: the messages are encoded (and mutated) by the fuzzer.
#[derive(Clone, Copy, Default)]
struct Raw;

impl Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl Encoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for Raw {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        Ok(Some(src.copy_to_bytes(src.remaining()).to_vec()))
    }
}

/// What the generators know about the workers.
struct World {
    prefill_url: String,
    kv_address: pb::KvWorkerAddress,
    region: pb::KvRegion,
    region_blocks: u32,
    block_bytes: u64,
}

fn constraint(rng: &mut StdRng) -> Option<pb::Constraint> {
    use pb::constraint::Kind;
    if rng.gen_bool(0.75) {
        return None;
    }
    let schema =
        r#"{"type":"object","properties":{"a":{"type":"integer","minimum":0}},"required":["a"]}"#;
    let kind = match rng.gen_range(0..5) {
        0 => Kind::JsonObject(rng.gen()),
        1 => {
            let mut v: serde_json::Value = serde_json::from_str(schema).expect("schema");
            for _ in 0..rng.gen_range(0..3) {
                mutate::json(rng, &mut v);
            }
            Kind::JsonSchema(String::from_utf8_lossy(&mutate::render(&v)).into_owned())
        }
        2 => Kind::Regex(
            (*["[a-z]+", "(", "\\d{3}-\\d{4}", "a{1000}", "(a|b)*c", ""]
                .choose(rng)
                .expect("regexes"))
            .to_string()
                + &mutate::string(rng),
        ),
        3 => Kind::Lark(
            (*[
                "start: \"yes\" | \"no\"",
                "start: x\nx: x",
                "start:",
                "%import common",
            ]
            .choose(rng)
            .expect("grammars"))
            .to_string(),
        ),
        _ => Kind::Choice(pb::constraint::Choices {
            choices: (0..rng.gen_range(0..4))
                .map(|_| mutate::string(rng))
                .collect(),
        }),
    };
    Some(pb::Constraint { kind: Some(kind) })
}

fn params(rng: &mut StdRng) -> Option<pb::SamplingParams> {
    if rng.gen_bool(0.03) {
        return None;
    }
    let edge_or = |rng: &mut StdRng, usual: f32| {
        if rng.gen_bool(0.8) {
            usual
        } else {
            mutate::edge_f32(rng)
        }
    };
    Some(pb::SamplingParams {
        temperature: edge_or(rng, 0.0),
        top_k: mutate::edge_u32(rng, 50),
        top_p: edge_or(rng, 1.0),
        seed: rng.gen_bool(0.5).then(|| mutate::edge_u64(rng)),
        max_tokens: mutate::edge_u32(rng, 12),
        stop: (0..rng.gen_range(0..3))
            .map(|_| mutate::string(rng))
            .collect(),
        stop_token_ids: (0..rng.gen_range(0..3))
            .map(|_| mutate::edge_u32(rng, 300))
            .collect(),
        ignore_eos: rng.gen(),
        logprobs: rng.gen_bool(0.3).then(|| mutate::edge_u32(rng, 5)),
        constraint: constraint(rng),
    })
}

fn tokens(rng: &mut StdRng, most: usize) -> Vec<u32> {
    let n = match rng.gen_range(0..20) {
        0 => 0,
        1 => rng.gen_range(400..1_200),
        _ => rng.gen_range(1..most),
    };
    let mut ids: Vec<u32> = (0..n)
        .map(|_| rng.gen_range(0..tiny::VOCAB as u32))
        .collect();
    if n > 0 && rng.gen_bool(0.05) {
        // One id outside the vocabulary.
        ids[rng.gen_range(0..n)] = mutate::edge_u64(rng).max(tiny::VOCAB as u64) as u32;
    }
    ids
}

fn generate(rng: &mut StdRng, w: &World) -> pb::GenerateRequest {
    let garbage: String = (0..rng.gen_range(0..12))
        .map(|_| *b"abcxyz09 _-".choose(rng).expect("chars") as char)
        .collect();
    pb::GenerateRequest {
        request_id: mutate::string(rng),
        prompt: tokens(rng, 80),
        params: params(rng),
        prefill_endpoint: match rng.gen_range(0..10) {
            0..=4 => None,
            5..=7 => Some(w.prefill_url.clone()),
            8 => Some(REFUSED.to_string()),
            _ => Some(garbage),
        },
        resume: if rng.gen_bool(0.15) {
            tokens(rng, 20)
        } else {
            Vec::new()
        },
    }
}

/// A text field byte-mutated (lossily back to UTF-8).
fn mutated_text(rng: &mut StdRng, s: &str) -> String {
    let mut b = s.as_bytes().to_vec();
    mutate::bytes(rng, &mut b);
    String::from_utf8_lossy(&b).into_owned()
}

/// `a`, or with probability `p` absent or with a field mutated.
fn maybe_mutated_address(
    rng: &mut StdRng,
    a: &pb::KvWorkerAddress,
    p: f64,
) -> Option<pb::KvWorkerAddress> {
    let mut a = a.clone();
    if rng.gen_bool(p) {
        match rng.gen_range(0..3) {
            0 => return None,
            1 => a.tcp = mutated_text(rng, &a.tcp),
            _ => {
                let mut b = a.ucx.unwrap_or_default();
                mutate::bytes(rng, &mut b);
                a.ucx = Some(b);
            }
        }
    }
    Some(a)
}

/// `r`, or with probability `p` absent or with a field mutated.
fn maybe_mutated_region(rng: &mut StdRng, r: &pb::KvRegion, p: f64) -> Option<pb::KvRegion> {
    let mut r = r.clone();
    if rng.gen_bool(p) {
        match rng.gen_range(0..5) {
            0 => return None,
            1 => r.owner = mutated_text(rng, &r.owner),
            2 => r.id = mutate::edge_u64(rng),
            3 => r.len = mutate::edge_u64(rng),
            _ => {
                let mut u = r.ucx.unwrap_or_default();
                u.base = mutate::edge_u64(rng);
                mutate::bytes(rng, &mut u.rkey);
                r.ucx = Some(u);
            }
        }
    }
    Some(r)
}

fn prefill(rng: &mut StdRng, w: &World) -> pb::PrefillRequest {
    let prompt = tokens(rng, 80);
    let need = prompt.len().div_ceil(16);
    let blocks = (need + rng.gen_range(0..3)).saturating_sub(rng.gen_range(0..2));
    pb::PrefillRequest {
        request_id: mutate::string(rng),
        prompt,
        params: params(rng),
        destination: rng.gen_bool(0.95).then(|| pb::KvDestination {
            worker_address: maybe_mutated_address(rng, &w.kv_address, 0.2),
            region: maybe_mutated_region(rng, &w.region, 0.2),
            blocks: (0..blocks)
                .map(|_| {
                    if rng.gen_bool(0.05) {
                        mutate::edge_u64(rng) as u32
                    } else {
                        rng.gen_range(0..w.region_blocks)
                    }
                })
                .collect(),
            block_bytes: if rng.gen_bool(0.8) {
                w.block_bytes
            } else {
                mutate::edge_u64(rng)
            },
            skip_blocks: if rng.gen_bool(0.8) {
                0
            } else {
                mutate::edge_u32(rng, 4)
            },
            ranks: (0..usize::from(rng.gen_bool(0.05)))
                .map(|_| pb::KvRankRegion {
                    worker_address: Some(w.kv_address.clone()),
                    region: maybe_mutated_region(rng, &w.region, 0.5),
                })
                .collect(),
        }),
    }
}

/// Whether a host a worker would dial is this machine.
fn loopback_host(host: &str) -> bool {
    matches!(host, "127.0.0.1" | "localhost" | "[::1]" | "::1")
}

/// Keeps every address in a decoded `Generate` on loopback; true when it changed anything.
fn sanitize_generate(m: &mut pb::GenerateRequest) -> bool {
    let Some(e) = &m.prefill_endpoint else {
        return false;
    };
    let remote = e
        .parse::<tonic::codegen::http::Uri>()
        .ok()
        .and_then(|u| u.host().map(|h| !loopback_host(h)))
        .unwrap_or(false);
    if remote {
        m.prefill_endpoint = Some(REFUSED.to_string());
    }
    remote
}

/// Whether `addr` parses to an address on another host (one a worker would dial out to).
fn off_host(addr: &str) -> bool {
    addr.parse::<SocketAddr>()
        .is_ok_and(|a| !a.ip().is_loopback())
}

/// Replaces an address that names another host with `fallback`.
fn keep_local_address(a: &mut Option<pb::KvWorkerAddress>, fallback: &pb::KvWorkerAddress) -> bool {
    let remote = a.as_ref().is_some_and(|a| off_host(&a.tcp));
    if remote {
        *a = Some(fallback.clone());
    }
    remote
}

/// Replaces a region whose owner is another host with `fallback`.
fn keep_local_region(r: &mut Option<pb::KvRegion>, fallback: &pb::KvRegion) -> bool {
    let remote = r.as_ref().is_some_and(|r| off_host(&r.owner));
    if remote {
        *r = Some(fallback.clone());
    }
    remote
}

/// Keeps every address in a decoded `Prefill` on loopback; true when it changed anything.
fn sanitize_prefill(m: &mut pb::PrefillRequest, w: &World) -> bool {
    let Some(d) = &mut m.destination else {
        return false;
    };
    let mut changed = keep_local_address(&mut d.worker_address, &w.kv_address);
    changed |= keep_local_region(&mut d.region, &w.region);
    for r in &mut d.ranks {
        changed |= keep_local_address(&mut r.worker_address, &w.kv_address);
        changed |= keep_local_region(&mut r.region, &w.region);
    }
    changed
}

/// Encodes `m`, byte-mutates a third of the cases; a mutant that decodes is sanitized.
/// Returns the bytes and whether they decode.
fn wire<M: Message + Default>(
    rng: &mut StdRng,
    m: &M,
    sanitize: impl Fn(&mut M) -> bool,
) -> (Vec<u8>, bool) {
    let mut bytes = m.encode_to_vec();
    if rng.gen_bool(0.33) {
        mutate::bytes(rng, &mut bytes);
    }
    match M::decode(bytes.as_slice()) {
        Ok(mut decoded) => {
            if sanitize(&mut decoded) {
                bytes = decoded.encode_to_vec();
            }
            (bytes, true)
        }
        Err(_) => (bytes, false),
    }
}

/// Why a status is a failure, if it is.
fn bad_status(s: &tonic::Status, decodes: bool) -> Option<String> {
    let bad = match s.code() {
        Code::Unknown | Code::DataLoss => true,
        Code::Internal => decodes,
        _ => false,
    };
    bad.then(|| format!("{:?}: {}", s.code(), s.message()))
}

async fn call_generate(ch: Channel, bytes: Vec<u8>, decodes: bool) -> Result<String, String> {
    let mut grpc = tonic::client::Grpc::new(ch);
    grpc.ready().await.map_err(|e| format!("not ready: {e}"))?;
    let path = PathAndQuery::from_static("/cleave.v1.DecodeWorker/Generate");
    let mut stream = match grpc
        .server_streaming(tonic::Request::new(bytes), path, Raw)
        .await
    {
        Ok(r) => r.into_inner(),
        Err(s) => return bad_status(&s, decodes).map_or(Ok(format!("{:?}", s.code())), Err),
    };
    let mut finished = false;
    loop {
        match stream.message().await {
            Ok(Some(bytes)) => {
                let ev = pb::GenerateEvent::decode(bytes.as_slice())
                    .map_err(|e| format!("an event that does not decode: {e}"))?;
                match ev.event {
                    Some(pb::generate_event::Event::Token(_)) if !finished => {}
                    Some(pb::generate_event::Event::Finished(_)) if !finished => finished = true,
                    other => return Err(format!("unexpected event {other:?}")),
                }
            }
            Ok(None) if finished => return Ok("finished".into()),
            Ok(None) => return Err("the stream ended without Finished".into()),
            Err(s) => {
                return bad_status(&s, decodes).map_or(Ok(format!("stream {:?}", s.code())), Err)
            }
        }
    }
}

async fn call_prefill(ch: Channel, bytes: Vec<u8>, decodes: bool) -> Result<String, String> {
    let mut grpc = tonic::client::Grpc::new(ch);
    grpc.ready().await.map_err(|e| format!("not ready: {e}"))?;
    let path = PathAndQuery::from_static("/cleave.v1.PrefillWorker/Prefill");
    match grpc.unary(tonic::Request::new(bytes), path, Raw).await {
        Ok(r) => pb::PrefillResponse::decode(r.into_inner().as_slice())
            .map(|_| "prefilled".to_string())
            .map_err(|e| format!("a response that does not decode: {e}")),
        Err(s) => bad_status(&s, decodes).map_or(Ok(format!("{:?}", s.code())), Err),
    }
}

/// Each worker's KV pool.
const KV_BLOCKS: usize = 96;

fn config(model: PathBuf) -> WorkerConfig {
    WorkerConfig {
        kv_blocks: Some(KV_BLOCKS),
        runtime_threads: 1,
        step_tokens: 64,
        prefill_tokens_while_decoding: 0,
        transport: BackendChoice::Tcp,
        prefill_timeout: Duration::from_secs(5),
        ..WorkerConfig::defaults(model)
    }
}

/// Waits until `w` runs nothing and holds no block in use; the stats when it does not.
async fn settled(w: &Running) -> Result<(), String> {
    for _ in 0..500 {
        let s = w.state.engine.stats();
        if s.running == 0 && s.waiting == 0 && s.parked == 0 && s.held == 0 && s.pool.used == 0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(format!("{:?}", w.state.engine.stats()))
}

async fn health(addr: SocketAddr) -> Result<(), String> {
    let r = reqwest::get(format!("http://{addr}/health"))
        .await
        .map_err(|e| e.to_string())?;
    match r.status().as_u16() {
        200 => Ok(()),
        s => Err(format!("status {s}")),
    }
}

/// The campaign.
pub fn fuzz(cases: Cases) -> anyhow::Result<Tally> {
    let dir = std::env::temp_dir().join(format!("cleave-fuzz-grpc-{}", std::process::id()));
    tiny::write_model(
        &dir,
        tiny::Kind::Llama,
        cleave_text::safetensors::Dtype::F32,
        1,
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let result = rt.block_on(campaign(dir.clone(), cases));
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn campaign(model: PathBuf, cases: Cases) -> anyhow::Result<Tally> {
    let stop = CancellationToken::new();
    let _stop = stop.clone().drop_guard();
    let decode = run(DECODE, config(model.clone()), stop.clone()).await?;
    let prefill_worker = run(PREFILL, config(model), stop.clone()).await?;
    let world = World {
        prefill_url: format!("http://{}", prefill_worker.grpc_addr),
        kv_address: kv::address_to_wire(&decode.state.transport.local_address()),
        region: kv::region_to_wire(&decode.state.region.descriptor()),
        region_blocks: KV_BLOCKS as u32,
        block_bytes: decode.state.layout.block_bytes() as u64,
    };
    let to_decode = Channel::from_shared(format!("http://{}", decode.grpc_addr))?
        .connect()
        .await?;
    let to_prefill = Channel::from_shared(world.prefill_url.clone())?
        .connect()
        .await?;
    let mut tally = Tally::new("grpc");
    for i in cases.range() {
        let rng = &mut cases.rng(i);
        let (what, answer) = if rng.gen_bool(0.7) {
            let m = generate(rng, &world);
            let (bytes, decodes) = wire(rng, &m, sanitize_generate);
            let call = call_generate(to_decode.clone(), bytes, decodes);
            ("generate", tokio::time::timeout(CASE_TIMEOUT, call).await)
        } else {
            let m = prefill(rng, &world);
            let (bytes, decodes) = wire(rng, &m, |m| sanitize_prefill(m, &world));
            let call = call_prefill(to_prefill.clone(), bytes, decodes);
            ("prefill", tokio::time::timeout(CASE_TIMEOUT, call).await)
        };
        match answer {
            Err(_) => tally.fail(i, format!("{what}: no answer within {CASE_TIMEOUT:?}")),
            Ok(Err(e)) => tally.fail(i, format!("{what}: {e}")),
            Ok(Ok(outcome)) => tally.ok(format!("{what}:{outcome}")),
        }
    }
    for (name, w) in [("decode", &decode), ("prefill", &prefill_worker)] {
        if let Err(e) = health(w.http_addr).await {
            tally.fail_after(format!("the {name} worker's /health: {e}"));
        }
        if let Err(stats) = settled(w).await {
            tally.fail_after(format!("the {name} worker did not settle: {stats}"));
        }
    }
    Ok(tally)
}
