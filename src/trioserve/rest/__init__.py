"""The REST (HTTP/JSON) front end: HTTP servers, ASGI app and routing."""
