"""Router: OpenAI-compatible API, instance pools and policies, admin API and CLI (issue 6). Imports no torch."""
