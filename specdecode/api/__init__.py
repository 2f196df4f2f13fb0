"""The public client side: the gRPC client SDK and the result types it and the servers
share (usage counts, finish reasons). Imports nothing of the orchestrator."""
