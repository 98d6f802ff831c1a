"""Router: OpenAI-compatible API, instance pools and policies, admin API and CLI. Imports no torch."""
