//! Batch invariance of worker groups whose ranks talk over real network collectives (threads
//! of this process joined over loopback TCP, the same `NetGroup` the worker processes use): a
//! request's tokens and logprobs are bit-identical whatever its prefill chunk budget (16, 256,
//! 4096), whether it runs alone or batched with 15 other requests of different lengths, hits
//! or misses the prefix cache, or is preempted and recomputed. Checked for a TP=3 group of the
//! default model, EP=2 groups of tiny MoE checkpoints (Qwen2-MoE with its shared expert,
//! Mixtral), and the single process (TP=1). See docs/collectives.md, "Batch invariance".

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use cleave_collective::{GroupConfig, NetGroup};
use cleave_engine::engine::{
    run_follower, Engine, EngineConfig, FinishReason, GenerateRequest, GroupLink, SeqEvent,
};
use cleave_engine::kernels::Threads;
use cleave_engine::kv::memory::{KvCache, KvDtype};
use cleave_engine::load::Loaded;
use cleave_engine::schedule::SchedulerConfig;
use cleave_text::gguf::default_model_path;
use cleave_text::sample::SamplingParams;
use cleave_text::tiny::{write_model, write_tokenizer, Kind};
use cleave_types::collective::Collective;

/// One generated token: id, logprob bits, top-2 `(id, logprob bits)`.
type Tok = (u32, u32, Vec<(u32, u32)>);

/// A request's whole output and how many of its prompt tokens came from the prefix cache.
#[derive(Clone, Debug, PartialEq)]
struct Trace {
    tokens: Vec<Tok>,
    cached: usize,
}

/// How a group is run.
#[derive(Clone, Copy)]
struct Setup<'a> {
    model: &'a Path,
    world: usize,
    step_tokens: usize,
    num_blocks: usize,
    prefix_caching: bool,
    /// The collectives' direct-exchange threshold (small so that a tiny model's all-reduces
    /// take both the direct and the segmented path).
    small_bytes: usize,
}

/// A leader engine and its follower threads (their outcome comes back on `done`).
struct Group {
    engine: Engine,
    followers: usize,
    done: mpsc::Receiver<Result<u64, String>>,
}

impl Group {
    fn start(s: Setup) -> Group {
        let config = EngineConfig {
            tiers: Default::default(),
            num_blocks: s.num_blocks,
            kv_dtype: KvDtype::F32,
            max_model_len: None,
            scheduler: SchedulerConfig {
                step_tokens: s.step_tokens,
                prefix_caching: s.prefix_caching,
                ..Default::default()
            },
        };
        let (tx, done) = mpsc::channel();
        if s.world == 1 {
            let l = Loaded::open(s.model, Threads::single()).expect("load the model");
            let engine = Engine::start(l.model, l.tokenizer, config);
            return Group {
                engine,
                followers: 0,
                done,
            };
        }
        let small = s.small_bytes;
        let tweak = move |c: &mut GroupConfig| {
            c.small_bytes = small;
            c.timeout = Duration::from_secs(60);
        };
        let (pending, addr) = common::leader(s.world, &tweak);
        for rank in 1..s.world {
            let cfg = common::config(rank, s.world, &addr, &tweak);
            let (tx, path, blocks) = (tx.clone(), s.model.to_path_buf(), s.num_blocks);
            std::thread::spawn(move || {
                let run = || -> Result<u64, String> {
                    let c: Arc<dyn Collective> =
                        Arc::new(NetGroup::connect(cfg).map_err(|e| e.to_string())?);
                    let l = Loaded::open_rank(&path, c.clone(), Threads::single())
                        .map_err(|e| e.to_string())?;
                    let mut cache = cache_for(&l, blocks);
                    run_follower(&l.model, &mut cache, c.as_ref()).map_err(|e| e.to_string())
                };
                let _ = tx.send(run());
            });
        }
        let c: Arc<dyn Collective> = Arc::new(pending.join().expect("rank 0 joins"));
        let l = Loaded::open_rank(s.model, c.clone(), Threads::single()).expect("load rank 0");
        let cache = cache_for(&l, s.num_blocks);
        let engine = Engine::start_leader(
            l.model,
            l.tokenizer,
            config,
            cache,
            Some(GroupLink {
                collective: c,
                heartbeat: Duration::from_secs(5),
            }),
        );
        Group {
            engine,
            followers: s.world - 1,
            done,
        }
    }

    /// Stops the leader and checks that every follower stopped cleanly.
    fn stop(self) {
        assert!(!self.engine.stats().failed, "the group failed");
        drop(self.engine);
        for _ in 0..self.followers {
            let r = self
                .done
                .recv_timeout(common::WATCHDOG)
                .expect("a follower hung (watchdog) or panicked");
            r.expect("followers stop cleanly");
        }
    }

    /// Submits every request at once (so they share steps) and collects their outputs.
    /// Submits `reqs` in order; their event streams.
    fn submit(
        &self,
        reqs: &[(Vec<u32>, SamplingParams)],
    ) -> Vec<tokio::sync::mpsc::UnboundedReceiver<SeqEvent>> {
        reqs.iter()
            .map(|(p, params)| {
                let req = GenerateRequest::new(p.clone(), params.clone());
                self.engine.submit(req).expect("submit").1
            })
            .collect()
    }

    async fn run(&self, reqs: &[(Vec<u32>, SamplingParams)]) -> Vec<Trace> {
        let rxs = self.submit(reqs);
        let mut out = Vec::new();
        for rx in rxs {
            out.push(trace(rx).await);
        }
        out
    }

    /// Each request on its own, one after the other.
    async fn alone(&self, reqs: &[(Vec<u32>, SamplingParams)]) -> Vec<Trace> {
        let mut out = Vec::new();
        for r in reqs {
            out.extend(self.run(std::slice::from_ref(r)).await);
        }
        out
    }
}

fn cache_for(l: &Loaded, blocks: usize) -> KvCache {
    let m = &l.model;
    let layout = m.kv_layout(cleave_engine::kv::DEFAULT_BLOCK_SIZE, KvDtype::F32);
    KvCache::on_heap(layout, blocks)
}

async fn trace(mut rx: tokio::sync::mpsc::UnboundedReceiver<SeqEvent>) -> Trace {
    let mut tokens = Vec::new();
    let deadline = tokio::time::Instant::now() + common::WATCHDOG * 3;
    loop {
        let ev = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .expect("request did not finish (watchdog)");
        match ev {
            Some(SeqEvent::Token { id, logprob, .. }) => {
                let lp = logprob.expect("logprobs were requested");
                let top = lp.top.iter().map(|&(t, p)| (t, p.to_bits())).collect();
                tokens.push((id, lp.logprob.to_bits(), top));
            }
            Some(SeqEvent::Done { reason, usage, .. }) => {
                assert_eq!(reason, FinishReason::Length);
                return Trace {
                    tokens,
                    cached: usage.cached_tokens,
                };
            }
            Some(_) => {}
            None => panic!("stream ended without Done"),
        }
    }
}

fn params(max_tokens: usize, seed: Option<u64>) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ignore_eos: true,
        logprobs: Some(2),
        temperature: if seed.is_some() { 0.8 } else { 0.0 },
        seed,
        ..Default::default()
    }
}

/// The long request first (greedy, `long` prompt tokens), then 15 others of different lengths
/// taken from elsewhere in the text (one with seeded sampling), so no two share a prefix.
fn requests(l: &Loaded, long: usize) -> Vec<(Vec<u32>, SamplingParams)> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../engine/tests/data/apache2_excerpt.txt"
    ))
    .expect("the reference text");
    let ids = l.tokenizer.encode(&text, false);
    let vocab = l.model.config.vocab as u32;
    let ids: Vec<u32> = ids
        .into_iter()
        .map(|t| t % vocab)
        .collect::<Vec<_>>()
        .repeat(2);
    assert!(ids.len() >= long + 15 * 40, "text too short");
    let mut reqs = vec![(ids[..long].to_vec(), params(8, None))];
    for i in 0..15 {
        let (start, len) = (long + i * 40, 3 + (i * 7) % 37);
        let seed = (i == 4).then_some(7);
        reqs.push((ids[start..start + len].to_vec(), params(3 + i % 4, seed)));
    }
    reqs
}

/// Every invariance for one model and group size.
async fn check_invariance(model: &Path, world: usize, long: usize, small_bytes: usize) {
    let l = Loaded::open(model, Threads::single()).expect("load the model");
    let reqs = requests(&l, long);
    drop(l);
    let setup = |step_tokens, num_blocks, prefix_caching| Setup {
        model,
        world,
        step_tokens,
        num_blocks,
        prefix_caching,
        small_bytes,
    };
    let name = format!("{} world {world}", model.display());

    // Reference: each request alone, the whole prompt in one chunk.
    let g = Group::start(setup(4096, 256, true));
    let want = g.alone(&reqs).await;
    assert_eq!(want[0].cached, 0);
    // The long prompt again: a prefix-cache hit, same bits.
    let hit = g.run(&reqs[..1]).await.remove(0);
    assert!(hit.cached >= long / 16 * 16 - 16, "{name}: no prefix hit");
    assert_eq!(hit.tokens, want[0].tokens, "{name}: prefix hit vs miss");
    g.stop();

    let same = |got: &[Trace], what: &str| {
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.tokens, w.tokens, "{name}: request {i} differs ({what})");
        }
    };
    for budget in [16, 256] {
        let g = Group::start(setup(budget, 256, false));
        same(
            &g.run(&reqs[..1]).await,
            &format!("alone, chunk budget {budget}"),
        );
        same(
            &g.run(&reqs).await,
            &format!("batched, chunk budget {budget}"),
        );
        g.stop();
    }
    // Too few blocks for everyone: the newest running sequences are preempted and recomputed.
    // Submitted newest-first, the long request is the newest: it is the one preempted when an
    // older sequence needs a block, and is recomputed (prompt and generated tokens) later.
    let g = Group::start(setup(256, 26, false));
    let reversed: Vec<_> = reqs.iter().rev().cloned().collect();
    // All queued before the first step, so that they compete for blocks whatever the timing.
    g.engine.hold();
    let rxs = g.submit(&reversed);
    g.engine.resume();
    let mut got = Vec::new();
    for rx in rxs {
        got.push(trace(rx).await);
    }
    got.reverse();
    same(&got, "under preemption");
    let preempted = g.engine.stats().counters.preemptions;
    assert!(preempted > 0, "{name}: nothing was preempted");
    g.stop();
}

/// A tiny checkpoint written for this test; removed on drop.
struct TinyDir(PathBuf);

impl TinyDir {
    fn new(kind: Kind, name: &str) -> TinyDir {
        let dir = std::env::temp_dir().join(format!("cleave-det-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        write_model(&dir, kind, cleave_text::safetensors::Dtype::F32, 11).unwrap();
        write_tokenizer(&dir).unwrap();
        TinyDir(dir)
    }
}

impl Drop for TinyDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn default_model() -> PathBuf {
    let path = default_model_path();
    assert!(
        path.exists(),
        "the default model is not at {}: run `cargo run -p cleave -- model fetch` (the test script does)",
        path.display()
    );
    path
}

/// A 330-token prompt: 21 blocks, several chunks at budget 256, and all-reduces of up to
/// 1.5 MB, far above the direct-exchange threshold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tp3_group_is_batch_invariant_bit_for_bit() {
    check_invariance(&default_model(), 3, 330, 64 * 1024).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_single_process_is_batch_invariant_bit_for_bit() {
    check_invariance(&default_model(), 1, 330, 64 * 1024).await;
}

/// Qwen2-MoE: a shared expert next to the routed ones, so a token's output mixes the routed
/// part (computed on the rank that owns the token in this step) with every rank's share of
/// the shared expert. A 1 KiB direct-exchange threshold puts steps of more than 2 tokens on
/// the segmented all-reduce.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ep2_group_with_a_shared_expert_is_batch_invariant_bit_for_bit() {
    let dir = TinyDir::new(Kind::Qwen2Moe, "qwen2moe");
    check_invariance(&dir.0, 2, 300, 1024).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ep2_mixtral_group_is_batch_invariant_bit_for_bit() {
    let dir = TinyDir::new(Kind::Mixtral, "mixtral");
    check_invariance(&dir.0, 2, 300, 1024).await;
}
