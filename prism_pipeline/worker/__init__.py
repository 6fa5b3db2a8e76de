"""`prism run`: the Kafka worker (evidence topic in, decision records and dead letters out)."""
