"""`prism serve`: the TypeSafe `/v1/systemone` HTTP API over one engine."""
