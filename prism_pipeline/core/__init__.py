"""The decision step every room shares: an event in, the engine's request, the engine call
(retried alone on failure), a record or a dead letter out; batching, seeds, ceilings, the engine
setup. Nothing here knows Kafka, HTTP or files."""
