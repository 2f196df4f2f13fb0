"""Where a forward runs: the model runner and its KV pool, the attention backends (eager,
static, compiled), row-invariant numerics, the device, the worker that samples, and timing
forwards into a cost table. Imports no serving, wire, models or telemetry code."""
