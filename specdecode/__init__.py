"""specdecode shared library: data model, model runner, sampling, devices, telemetry."""
