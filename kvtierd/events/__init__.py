"""Block-index events on their way out of the daemon: the pump that drains every pool into the Events
stream's history, and the KV event publisher in vLLM's wire format (ZMQ) with its [events] settings.
Below the server, which serves the stream."""
