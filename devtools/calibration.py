"""The simulator's vLLM flavor against the real vLLM CPU engine: the same workload on the same pool, compared
over the engine's own progress (`python -m devtools.calibration` prints the table; the burst takes 1 to 2 s
of engine time, its page read about ten times).

The workload is one burst: every request arrives at once, `requests` prompts of `prompt_tokens` tokens, the
first `prefix_tokens` of them one of `prefixes` shared prefixes (request i takes prefix i mod `prefixes`), each
answered with exactly `output_tokens` tokens. Both engines get `blocks` blocks of `block_size` tokens (vLLM's
--num-gpu-blocks-override, its null block included: the simulator gets one block less), `max_num_seqs` and
`max_num_batched_tokens`.

The time base is the engine's progress, the generation tokens it has produced (`vllm:generation_tokens_total`
and the model's count), not seconds: the tiny model on a shared 2-core CPU runs steps of uneven length, and the
simulator's step clock is a model of a GPU; what the exporter reports (usage, queueing, preemptions, hits) is a
function of the scheduler's decisions, which progress orders the same way on both.
"""

from __future__ import annotations

import argparse
import bisect
import tempfile
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path

from devtools import harness, vllm_engine
from kvcache_exporter.simulator.exposition import FLAVORS
from kvcache_exporter.simulator.model import EngineConfig, EngineModel, Request

SAMPLE_INTERVAL = 0.1  # seconds between two reads of vLLM's page


@dataclass(frozen=True)
class Workload:
    requests: int = 16
    prefixes: int = 4
    prefix_tokens: int = 32
    prompt_tokens: int = 96
    output_tokens: int = 64
    blocks: int = 32
    block_size: int = 32
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    max_model_len: int = 512  # vLLM refuses to start unless one request of this length fits the pool

    def engine_config(self) -> EngineConfig:
        return EngineConfig(num_blocks=self.blocks - 1, block_size=self.block_size, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            max_model_len=self.max_model_len, reserve_ratio_init=0.0,
                            reserve_ratio_min=0.0)

    def completions(self, seed: int = 0) -> list[vllm_engine.Completion]:
        heads = [vllm_engine.prompt(self.prefix_tokens, seed * 1_000_003 + index) for index in range(self.prefixes)]
        own = self.prompt_tokens - self.prefix_tokens
        return [vllm_engine.Completion(f"{heads[index % self.prefixes]} "
                                       f"{vllm_engine.prompt(own, -(seed * 1_000_003 + index + 1))}",
                                       self.output_tokens)
                for index in range(self.requests)]


@dataclass(frozen=True)
class Sample:
    generated: int  # generation tokens so far: the progress axis
    usage: float
    running: int
    waiting: int
    preemptions: int
    prefix_hits: int
    prefix_queries: int
    finished: int


SERIES = tuple(field.name for field in fields(Sample))[1:]


def simulate(workload: Workload, config: EngineConfig | None = None) -> list[Sample]:
    """The vLLM flavor's model on `workload`: one sample after every step, as vLLM's page refreshes."""
    config = config or workload.engine_config()
    model = EngineModel(config, FLAVORS["vllm-v1"].reporting)
    for index in range(workload.requests):
        model.submit(Request(index, 0.0, workload.prompt_tokens, workload.output_tokens,
                             prefix_id=index % workload.prefixes, prefix_len=workload.prefix_tokens))
    samples = []
    total = workload.requests * workload.output_tokens
    while model.counters.generation_tokens < total:
        if model.step() is None:
            break
        counters = model.counters
        samples.append(Sample(counters.generation_tokens, model.pool.used / config.num_blocks, len(model.running),
                              len(model.waiting), counters.preemptions_rescheduled, counters.prefix_hit_tokens,
                              counters.prefix_queried_tokens, counters.finished_requests))
    return samples


def page_sample(engine: vllm_engine.Engine) -> Sample:
    samples = engine.own_samples()

    def get(name: str) -> float:
        return sum(harness.series(samples, name).values())

    return Sample(int(get("vllm:generation_tokens_total")), get("vllm:kv_cache_usage_perc"),
                  int(get("vllm:num_requests_running")), int(get("vllm:num_requests_waiting")),
                  int(get("vllm:num_preemptions_total")), int(get("vllm:prefix_cache_hits_total")),
                  int(get("vllm:prefix_cache_queries_total")), int(get("vllm:request_success_total")))


def run_real(workload: Workload, log_dir: Path) -> tuple[list[Sample], list[vllm_engine.Outcome], float]:
    """The workload on a fresh vLLM engine: its page read every SAMPLE_INTERVAL until every request is answered;
    also the requests' outcomes and the engine's seconds under load."""
    with vllm_engine.serve(log_dir, blocks=workload.blocks, block_size=workload.block_size,
                           max_num_seqs=workload.max_num_seqs, max_model_len=workload.max_model_len,
                           kv_events=False,
                           extra_args=["--max-num-batched-tokens", str(workload.max_num_batched_tokens)]) as engine:
        samples = [page_sample(engine)]
        started = time.monotonic()
        load = vllm_engine.Load(engine, workload.completions(), concurrency=workload.requests, time_limit=300)
        stop = threading.Event()

        def read_pages():
            while not stop.wait(SAMPLE_INTERVAL):
                samples.append(page_sample(engine))

        reader = threading.Thread(target=read_pages, daemon=True)
        reader.start()
        outcomes = load.wait()
        stop.set()
        reader.join()
        seconds = time.monotonic() - started
        samples.append(harness.wait_until(lambda: _settled(engine, workload), timeout=30, what="the last step logged"))
    return samples, outcomes, seconds


def _settled(engine: vllm_engine.Engine, workload: Workload) -> Sample | None:
    sample = page_sample(engine)
    return sample if sample.generated == workload.requests * workload.output_tokens and not sample.running else None


@dataclass(frozen=True)
class Difference:
    mean: float  # mean |real - simulated| over the real engine's samples under the whole burst
    worst: float
    real_final: float
    sim_final: float
    compared: int  # real samples compared


def compare(real: list[Sample], sim: list[Sample], requests: int) -> dict[str, Difference]:
    """Each real sample under load against the simulator's state after the last step with no more generation
    tokens. A sample counts once vLLM's scheduler holds the whole burst (running, waiting or finished): the HTTP
    requests reach it one by one, and on a slow machine it runs steps on the first few while the rest are still
    being tokenized, where the simulator has them all at step 0."""
    progress = [sample.generated for sample in sim]
    under_load = [sample for sample in real if 0 < sample.generated and (sample.running or sample.waiting)
                  and sample.running + sample.waiting + sample.finished == requests]
    out = {}
    for name in SERIES:
        gaps = []
        for sample in under_load:
            at = sim[max(0, bisect.bisect_right(progress, sample.generated) - 1)]
            gaps.append(abs(getattr(sample, name) - getattr(at, name)))
        out[name] = Difference(sum(gaps) / len(gaps) if gaps else 0.0, max(gaps, default=0.0),
                               getattr(real[-1], name) - getattr(real[0], name), getattr(sim[-1], name),
                               len(gaps))
    return out


def table(differences: dict[str, Difference]) -> str:
    lines = [f"{'series':16}{'mean |diff|':>12}{'worst':>8}{'vLLM final':>12}{'sim final':>11}{'reads':>7}"]
    for name, diff in differences.items():
        lines.append(f"{name:16}{diff.mean:12.3f}{diff.worst:8.2f}{diff.real_final:12g}{diff.sim_final:11g}"
                     f"{diff.compared:7d}")
    return "\n".join(lines)


def peaks(samples: list[Sample]) -> str:
    return (f"peak usage {max(s.usage for s in samples):.2f}, peak waiting {max(s.waiting for s in samples)}, "
            f"peak running {max(s.running for s in samples)}")


def main() -> None:
    argparse.ArgumentParser(prog="python -m devtools.calibration", description=__doc__.split("\n\n")[0]).parse_args()
    workload = Workload()
    sim = simulate(workload)
    with tempfile.TemporaryDirectory(prefix="vllm-calibration-") as logs:
        real, outcomes, seconds = run_real(workload, Path(logs))
    failed = [outcome for outcome in outcomes if outcome.status != 200]
    print(f"{workload}\nvLLM {vllm_engine.VERSION}: {len(real)} page reads over {seconds:.1f} s, "
          f"{len(failed)} requests failed; {peaks(real)}\nsimulator: {len(sim)} steps; {peaks(sim)}")
    print(table(compare(real, sim, workload.requests)))


if __name__ == "__main__":
    main()
