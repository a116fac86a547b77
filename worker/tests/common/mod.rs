//! Helpers of the worker tests: worker settings, the single-process reference, a generate
//! call and the workers' HTTP endpoints.

#![allow(dead_code)] // each test binary uses its own subset

use std::time::Duration;

use cleave_engine::engine::{token_ids, Engine, EngineConfig, GenerateRequest};
use cleave_engine::kernels::Threads;
use cleave_engine::load::Loaded;
use cleave_kv_transfer::BackendChoice;
use cleave_proto::v1 as pb;
use cleave_proto::v1::decode_worker_client::DecodeWorkerClient;
use cleave_text::gguf::default_model_path;
use cleave_text::sample::SamplingParams;
use cleave_worker::{Running, WorkerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub fn config(transport: BackendChoice) -> WorkerConfig {
    WorkerConfig {
        kv_blocks: Some(128),
        step_tokens: 32,
        prefill_tokens_while_decoding: 0,
        transport,
        prefill_timeout: Duration::from_secs(20),
        ..WorkerConfig::defaults(default_model_path())
    }
}

pub fn greedy(n: u32) -> pb::SamplingParams {
    pb::SamplingParams {
        max_tokens: n,
        ignore_eos: true,
        top_p: 1.0,
        ..Default::default()
    }
}

pub async fn reference(prompt: &[u32], n: usize) -> Vec<u32> {
    let l = Loaded::open(&default_model_path(), Threads::single()).unwrap();
    let e = Engine::start(
        l.model.clone(),
        l.tokenizer.clone(),
        EngineConfig::default(),
    );
    let params = SamplingParams {
        max_tokens: n,
        ignore_eos: true,
        ..Default::default()
    };
    let (_, rx) = e
        .submit(GenerateRequest::new(prompt.to_vec(), params))
        .unwrap();
    token_ids(rx).await.0
}

pub async fn generate(
    decode: &Running,
    prompt: &[u32],
    prefill: Option<&Running>,
    n: u32,
) -> (Vec<u32>, pb::Finished) {
    let client = DecodeWorkerClient::connect(format!("http://{}", decode.grpc_addr))
        .await
        .unwrap();
    generate_on(client, prompt, prefill, n)
        .await
        .expect("the Generate call")
}

/// `generate` on a given client (TLS or plain); a refused call is the error.
pub async fn generate_on(
    mut client: DecodeWorkerClient<tonic::transport::Channel>,
    prompt: &[u32],
    prefill: Option<&Running>,
    n: u32,
) -> Result<(Vec<u32>, pb::Finished), tonic::Status> {
    let req = pb::GenerateRequest {
        request_id: "test".into(),
        prompt: prompt.to_vec(),
        params: Some(greedy(n)),
        prefill_endpoint: prefill.map(|p| format!("http://{}", p.grpc_addr)),
        resume: Vec::new(),
    };
    let mut stream = client.generate(req).await?.into_inner();
    let mut ids = Vec::new();
    while let Some(ev) = stream.message().await? {
        match ev.event.unwrap() {
            pb::generate_event::Event::Token(t) => ids.push(t.id),
            pb::generate_event::Event::Finished(f) => return Ok((ids, f)),
        }
    }
    panic!("stream ended without Finished");
}

pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

pub async fn settle(w: &Running) -> cleave_engine::engine::EngineStats {
    for _ in 0..400 {
        let s = w.state.engine.stats();
        if s.running == 0 && s.waiting == 0 && s.parked == 0 && s.held == 0 {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("worker did not settle: {:?}", w.state.engine.stats());
}

pub fn prompts() -> Vec<Vec<u32>> {
    let l = Loaded::open(&default_model_path(), Threads::single()).unwrap();
    let long = "Licensed under the Apache License, Version 2.0 (the \"License\"); you may not use this file except in compliance with the License. ".repeat(3);
    vec![
        l.tokenizer.encode("The capital of France is", false),
        l.tokenizer.encode(&long, false),
    ]
}
