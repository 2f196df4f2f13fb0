"""What a process tells about itself: spans (OpenTelemetry API helpers), the SDK set-up, the
log formats, and its metrics as they leave it (/metrics and OTLP). Imports no other room."""
