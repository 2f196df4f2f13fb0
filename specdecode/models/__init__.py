"""Where a model comes from: a transformers directory or a GGUF (converted once to a
safetensors cache), chunk packages, a served model from command-line options, tiny random
models for tests and benchmarks. Imports no serving, wire or telemetry code."""
