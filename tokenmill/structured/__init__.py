"""Structured outputs: a request's output constrained by a grammar (JSON, JSON schema, regex, choice, EBNF, a
structural tag for tool calls), compiled and matched by xgrammar. ``spec`` is plain data (no xgrammar import): it
travels with SamplingParams from the API to the engine, which compiles it (``grammar``) and keeps one matcher per
request (``matchers``) that yields the allowed-token bitmask of each sampled position."""
