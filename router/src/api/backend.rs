//! The boundary between the HTTP layer and the rest of the router.
//!
//! The API layer turns an OpenAI request into one [`BackendRequest`] per choice (token ids plus
//! sampling parameters) and hands it to a [`Backend`], which places and dispatches it and
//! returns a stream of [`BackendEvent`]s. The dispatch side implements [`Backend`]; tests use a
//! fake that streams canned tokens. Dropping a [`BackendStream`] cancels the generation
//! downstream, so the HTTP layer never holds one longer than its client connection.

use std::pin::Pin;

use cleave_text::sample::SamplingParams;

/// One generation to place and run: a tokenized prompt and how to sample from it.
#[derive(Clone, Debug, PartialEq)]
pub struct BackendRequest {
    /// Unique per generation (`<response id>-<choice index>`), for logs and traces.
    pub request_id: String,
    /// The prompt's token ids, BOS and chat template already applied.
    pub prompt: Vec<u32>,
    /// Sampling and stopping rules; `max_tokens` is always set by the API layer.
    pub params: SamplingParams,
    /// W3C trace context (`traceparent`) to continue in the workers.
    pub traceparent: Option<String>,
}

/// Why a generation ended (the one definition, in `cleave-types`).
pub use cleave_types::FinishReason;

/// What a generation reports, in order: tokens, then exactly one `Finished` or `Error`.
#[derive(Clone, Debug, PartialEq)]
pub enum BackendEvent {
    /// One sampled token.
    Token {
        /// The token id.
        id: u32,
        /// Text that became visible with this token (may be empty: incomplete UTF-8, or text
        /// held back because it could be the start of a stop string).
        text: String,
        /// The token's log-probability, when logprobs were requested.
        logprob: Option<f32>,
        /// The most likely alternatives with their log-probabilities, when requested.
        top: Vec<(u32, f32)>,
    },
    /// The generation ended normally or was cut short.
    Finished {
        /// Why it ended.
        reason: FinishReason,
        /// Tokens in the prompt.
        prompt_tokens: usize,
        /// Tokens generated.
        completion_tokens: usize,
        /// Prompt tokens whose KV was already cached (prefix reuse).
        cached_tokens: usize,
        /// Trailing text that was held back and is now final.
        text: String,
    },
    /// The worker failed mid-stream; the message is for logs, not for clients.
    Error(String),
    /// The worker failed mid-stream and the request could not be migrated; the message says
    /// why, for the client.
    Lost(String),
}

/// The events of one generation; dropping it cancels the generation downstream.
pub type BackendStream = Pin<Box<dyn tokio_stream::Stream<Item = BackendEvent> + Send>>;

/// Why a generation could not be started.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// No decode worker is registered or ready (HTTP 503).
    #[error("no workers are available to serve the request")]
    NoWorkers,
    /// Workers exist but could not take the request (HTTP 503); the detail is logged.
    #[error("workers are unavailable: {0}")]
    Unavailable(String),
    /// The request is valid OpenAI but cannot be served as asked (HTTP 400); the message is
    /// shown to the client.
    #[error("{0}")]
    BadRequest(String),
}

/// Places and runs generations; implemented by the dispatch side of the router.
#[async_trait::async_trait]
pub trait Backend: Send + Sync + 'static {
    /// Places and starts one generation; dropping the stream cancels it downstream.
    async fn generate(&self, req: BackendRequest) -> Result<BackendStream, BackendError>;
    /// Model name served (for `/v1/models` and request validation).
    fn model_name(&self) -> &str;
    /// Whether any decode worker is ready (for `/ready`).
    fn ready(&self) -> bool {
        self.healthy_decode_workers() > 0
    }
    /// How many decode workers placement may choose now (for `/metrics`).
    fn healthy_decode_workers(&self) -> usize;
}
