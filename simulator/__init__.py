"""A simulated vLLM / SGLang / TensorRT-LLM server: a KV-cache model behind an engine-shaped /metrics endpoint."""

from .server import SimulatedEngine, start_engine

__all__ = ["SimulatedEngine", "start_engine"]
