"""Durable state and what every layer shares: errors, config, the model store, the state DB, training data."""
