"""The orchestrator, in three rooms composed by `serve`:

- `engine/`: the step loop (plan, propose, score, verify, postprocess), the speculation
  policy, the rejection sampler, overlap and prefill pacing, deadlines, step metrics. It
  reaches the services only through `specdecode.interfaces` and imports neither room below.
- `cluster/`: the remote proposer and scorer clients, their replicas, routing and fan-out.
- `frontend/`: the public APIs (gRPC servicer, OpenAI HTTP), admission, request building.

The client SDK and the public result types are `specdecode.api` (no server imports)."""
