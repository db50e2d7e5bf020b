"""The HTTP API: the request pipeline, its Flask host, the handlers, the one route table,
request bodies, schemas and the OpenAPI document."""
