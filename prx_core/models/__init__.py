"""Captioning, labelling and embedding backends, the OpenAI-compatible client and server."""
