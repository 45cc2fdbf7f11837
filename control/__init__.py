"""The control plane: slots, the worker pool, worker handles, rollouts, jobs, the record watcher, events, metrics."""
