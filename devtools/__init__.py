"""Development tools: documentation and dashboard lint, the shared test and benchmark harness. Not shipped."""
