"""Run-time pieces shared by both servers: KV pool and page allocator, sampler, request types, the single-rank engine."""
