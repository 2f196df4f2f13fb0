"""How a call is served: the gRPC server (auth, TLS, strict decoding, error mapping, drain),
what the proposer and scorer servicers share (limits, leases, one model call at a time,
re-measuring costs while idle), health and a served model's metrics."""
