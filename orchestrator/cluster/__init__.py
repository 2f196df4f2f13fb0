"""How the engine reaches the proposer and scorer services: remote clients over gRPC,
replica sets with sequence-affine routing, health and failover, and the fan-out that
splits a step across replicas (implementing specdecode.interfaces)."""
