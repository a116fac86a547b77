//! Logging and tracing setup shared by cleave's binaries.
//!
//! [`init`] installs a `tracing` subscriber writing to stderr (filter from `CLEAVE_LOG`) and,
//! only when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, an OpenTelemetry layer that exports spans
//! over OTLP/HTTP (protobuf) to `$OTEL_EXPORTER_OTLP_ENDPOINT/v1/traces`. The per-request
//! spans continue the caller's W3C `traceparent` through [`set_parent`], and the hops pass
//! their own span's context on with [`traceparent_of`]; both are no-ops when export is off.
//! [`cancel_on_signal`] is the shutdown trigger every long-running binary uses, and
//! [`finish_tasks`] their bounded wait for the tasks they own once they have stopped serving.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The variable that turns export on (the standard OTLP one).
pub const ENDPOINT_VAR: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Flushes and shuts the span exporter down when dropped; keep it alive for the whole run.
#[must_use = "dropping the guard shuts span export down"]
pub struct Guard {
    provider: Option<SdkTracerProvider>,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard")
            .field("exporting", &self.provider.is_some())
            .finish()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            EXPORTING.store(false, Ordering::Relaxed);
            // shutdown flushes the batch processor (a blocking call on its own thread).
            if let Err(e) = provider.shutdown() {
                eprintln!("warning: shutting OpenTelemetry export down: {e}");
            }
        }
    }
}

/// [`init_with_default`] with the default filter "info".
pub fn init(service_name: &str) -> Guard {
    init_with_default(service_name, "info")
}

/// Installs the global subscriber: a fmt layer to stderr filtered by `CLEAVE_LOG` (else
/// `default_filter`) and, when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, OTLP/HTTP span export
/// under `service_name`. Export failing to start is reported on stderr, not fatal.
///
/// Colour codes only on a terminal: a pod's log (`kubectl logs`) is a file.
pub fn init_with_default(service_name: &str, default_filter: &str) -> Guard {
    let filter =
        || EnvFilter::try_from_env("CLEAVE_LOG").unwrap_or_else(|_| EnvFilter::new(default_filter));
    // OpenTelemetry's standard variable, which its exporter reads itself.
    #[allow(clippy::disallowed_methods)]
    let exporting = std::env::var_os(ENDPOINT_VAR).is_some_and(|v| !v.is_empty());
    let provider = if exporting {
        match provider(service_name) {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("warning: OpenTelemetry export disabled: {e}");
                None
            }
        }
    } else {
        None
    };
    let Some(provider) = provider else {
        // Exactly the subscriber the binaries always had.
        tracing_subscriber::fmt()
            .with_env_filter(filter())
            .with_writer(std::io::stderr)
            .with_ansi(colour())
            .init();
        return Guard { provider: None };
    };
    let tracer = provider.tracer("cleave");
    // The fmt layer keeps its own filter; the export layer takes cleave's spans down to debug
    // (the router's `api` and `admit` spans are debug spans) and anything else at info.
    let otel_filter = tracing_subscriber::filter::filter_fn(|meta| {
        let level = *meta.level();
        level <= tracing::Level::INFO
            || (meta.is_span()
                && level <= tracing::Level::DEBUG
                && meta.target().starts_with("cleave"))
    });
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(colour())
                .with_filter(filter()),
        )
        .with(
            tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_filter(otel_filter),
        )
        .init();
    EXPORTING.store(true, Ordering::Relaxed);
    Guard {
        provider: Some(provider),
    }
}

fn provider(service_name: &str) -> Result<SdkTracerProvider, Box<dyn std::error::Error>> {
    use opentelemetry_otlp::WithExportConfig;
    // The endpoint comes from OTEL_EXPORTER_OTLP_ENDPOINT (with /v1/traces appended), or
    // OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as given.
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .build()?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service_name.to_string())
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

/// Whether spans are being exported (so [`set_parent`] and [`traceparent_of`] do anything).
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// Makes `span` a child of the remote span in the W3C `traceparent` (if valid). Call it
/// before the span is first entered. A no-op when export is off.
pub fn set_parent(span: &tracing::Span, traceparent: Option<&str>) {
    let Some(tp) = traceparent.filter(|_| exporting()) else {
        return;
    };
    let carrier = HashMap::from([("traceparent".to_string(), tp.to_string())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    if cx.span().span_context().is_valid() {
        span.set_parent(cx);
    }
}

/// The W3C `traceparent` naming `span` itself, to pass to the next hop; `None` when export
/// is off or the span is disabled.
pub fn traceparent_of(span: &tracing::Span) -> Option<String> {
    if !exporting() || span.is_disabled() {
        return None;
    }
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove("traceparent")
}

/// How long a stopping server waits for its tasks once it has stopped serving.
pub const TASKS_PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);

/// Closes `tasks` and waits up to `patience` for them to end; those still running are logged
/// (the runtime's shutdown then drops them).
pub async fn finish_tasks(tasks: &tokio_util::task::TaskTracker, patience: std::time::Duration) {
    tasks.close();
    if tokio::time::timeout(patience, tasks.wait()).await.is_err() {
        tracing::warn!(
            left = tasks.len(),
            ?patience,
            "tasks still running after the stop; not waiting for them"
        );
    }
}

/// Cancels `token` on Ctrl-C or SIGTERM (must be called inside a tokio runtime).
pub fn cancel_on_signal(token: tokio_util::sync::CancellationToken) {
    let stop = token.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        stop.cancel();
    });
    #[cfg(unix)]
    tokio::spawn(async move {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
            token.cancel();
        }
    });
}

fn colour() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal()
}

/// The multi-thread tokio runtime of a server binary, with `threads` worker threads (its
/// `--runtime-threads` flag; at least 1).
pub fn runtime(threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()
}

/// `e` and its sources as one line, `outer: inner: …` (as anyhow's `{:#}` prints a chain). A
/// source whose text the message before it already contains is not repeated.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut last = out.clone();
    let mut next = e.source();
    while let Some(s) = next {
        let text = s.to_string();
        if !last.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        last = text;
        next = s.source();
    }
    out
}

#[cfg(test)]
mod chain_tests {
    use super::error_chain;

    #[derive(Debug, thiserror::Error)]
    #[error("reading the file")]
    struct Outer(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("reading the file: {0}")]
    struct Inline(#[source] std::io::Error);

    #[test]
    fn sources_are_appended_once() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        assert_eq!(error_chain(&Outer(io())), "reading the file: no such file");
        assert_eq!(error_chain(&Inline(io())), "reading the file: no such file");
    }
}
