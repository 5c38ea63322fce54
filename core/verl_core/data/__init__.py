"""The batch contract (verl's key names), global counts, micro-batching."""
