"""What travels between processes: the codec between the data model and the protobuf
messages of specdecode.v1 (codec), and sequence deltas, both halves: the encoder (the
orchestrator sends what a service lacks) and the store (a service rebuilds full sequences
from what it holds). Imports no executor, models, serving or telemetry code."""
