"""The process around the pipeline steps: targets, the poll cadence, probes, the HTTP endpoint, wiring."""
