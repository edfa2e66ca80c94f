"""Step 1 of the pipeline: wire formats in (HTTP exposition pages), nothing of engines."""
