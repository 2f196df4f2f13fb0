"""specdecode shared library: data model, model runner, sampling, devices, wire codec, servers, tracing, logs."""
