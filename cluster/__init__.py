"""The cluster backend: the record, heartbeats and the job queue in Redis, and a node's side of them."""
