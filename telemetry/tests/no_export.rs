//! Without OTEL_EXPORTER_OTLP_ENDPOINT, `init` installs only the stderr subscriber and the
//! trace helpers do nothing.

#[test]
fn without_the_endpoint_nothing_is_exported() {
    std::env::remove_var("OTEL_EXPORTER_OTLP_ENDPOINT");
    let _guard = cleave_telemetry::init("cleave-telemetry-test");
    assert!(!cleave_telemetry::exporting());
    let span = tracing::info_span!("api");
    cleave_telemetry::set_parent(
        &span,
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    );
    assert_eq!(cleave_telemetry::traceparent_of(&span), None);
}
