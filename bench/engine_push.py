"""A real model's weights pushed to a real engine that is generating: how long the push takes, how
long generation stops, and how many tokens the engine made while the weights were arriving.

    python -m millstream.bench.engine_push --model ~/.cache/millstream/models/SmolLM2-135M-Instruct

One vLLM actor (`python -m millstream.actor actor.kind=vllm`, loopback, no CURVE) serves the
model; a client keeps `--streams` requests of 64 tokens in flight the whole time (as an envpool
would), and the learner's single-replica path (`WeightSender`, learner/sync/weights.py) pushes
the model's own weights (transformers, float32, tied weights once, as the learner sends them)
`--pushes` times, `--gap-s` apart. Per push:

- `total_s`: the push as the learner waits for it (first byte to `WeightsApplied`);
- `receive_s`: the actor's receive, generation going on (actor/receive.py);
- `paused_s`: the actor's pause: vLLM's reload of the weights (and the repack of tied layers);
- tokens/s the client received during the push, against the `--gap-s` before it (the actor
  streams every token as its own delta here, `actor.stream_interval=1`, so arrivals are as
  fine-grained as the engine's steps).

Medians and ranges over the pushes (the first, which allocates the buffers, is not counted).
Results: bench/results/<date>-<host>/engine-push.json.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import torch
import zmq

from millstream.bench.kit.replicas import replicas
from millstream.bench.kit.rounds import machine, results_dir
from millstream.bench.kit.scratch import scratch
from millstream.learner.sync.weights import WeightSender
from millstream.shared.config import LearnerConfig
from millstream.shared.wire import Codec, GenerateRequest, TokenDelta

__all__ = ["main"]


class Streams:
    """A thread keeping `count` requests in flight on one DEALER; records when tokens arrive."""

    def __init__(self, address: str, count: int, prompt: list[int]) -> None:
        self.arrivals: list[tuple[float, int]] = []  # (time, tokens)
        self._address, self._count, self._prompt = address, count, prompt
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _request(self, sock: zmq.Socket, codec: Codec, n: int) -> None:
        request = GenerateRequest(f"r{n}", self._prompt, 64, ignore_eos=True, min_tokens=64)
        sock.send(codec.encode([request]))

    def _run(self) -> None:
        codec = Codec()
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._address)
        sent = 0
        for _ in range(self._count):
            self._request(sock, codec, sent)
            sent += 1
        while not self._stop.is_set():
            if not sock.poll(100):
                continue
            for message in codec.decode(sock.recv()):
                if isinstance(message, TokenDelta):
                    self.arrivals.append((time.perf_counter(), len(message.token_ids)))
                    if message.finish_reason is not None:
                        self._request(sock, codec, sent)
                        sent += 1
        sock.close(linger=0)

    def rate(self, start: float, end: float) -> float:
        """Tokens per second that arrived within [start, end)."""
        return sum(n for t, n in self.arrivals if start <= t < end) / max(end - start, 1e-9)

    @contextmanager
    def running(self) -> Iterator[Streams]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(timeout=10)


def model_weights(model: Path) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters as the learner sends them (a tied head once, under the embedding)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    return [(name, param.detach()) for name, param in hf.named_parameters()]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(ns: argparse.Namespace, work: Path) -> dict[str, Any]:
    weights = model_weights(ns.model)
    overrides = [
        "actor.kind=vllm", "actor.max_model_len=1024", "actor.kv_cache_bytes=1073741824",
        f"actor.max_num_seqs={max(ns.streams, 1)}", "actor.startup_timeout_s=600",
        "actor.stream_interval=1",  # every token its own delta: arrival times resolve the pause
    ]  # fmt: skip
    cfg = LearnerConfig(sync_backend="gloo", sync_timeout_s=300)
    pushes: list[dict[str, float]] = []
    with replicas(1, overrides, ns.model, work) as started:
        sender = WeightSender(started[0][0], cfg, dtype="float32", keys=None, hello_timeout_s=600)
        sender.attach()
        with Streams(started[0][0], ns.streams, list(range(100, 132))).running() as streams:
            sender.push(weights, 1)  # allocates the buffers on both sides: not counted
            for version in range(2, ns.pushes + 2):
                time.sleep(ns.gap_s)
                began = time.perf_counter()
                metrics = sender.push(weights, version)
                ended = time.perf_counter()
                metrics["tokens_per_s_during"] = streams.rate(began, ended)
                metrics["tokens_per_s_before"] = streams.rate(began - ns.gap_s, began)
                pushes.append(metrics)
                print({k: round(v, 3) for k, v in metrics.items()}, flush=True)
        sender.close()
    keys = [
        "sync/total_s",
        "sync/actor_receive_s",
        "sync/actor_paused_s",
        "tokens_per_s_during",
        "tokens_per_s_before",
    ]
    return {
        "model": str(ns.model),
        "bytes": pushes[0]["sync/bytes"],
        "streams": ns.streams,
        "pushes": pushes,
        "summary": {k: spread([p.get(k, 0.0) for p in pushes]) for k in keys},
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m millstream.bench.engine_push", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", type=Path, required=True, help="a model directory (make real-model)")
    p.add_argument("--pushes", type=int, default=6, help="pushes counted (one more warms up)")
    p.add_argument("--streams", type=int, default=8, help="requests kept in flight (0: an idle engine)")
    p.add_argument("--gap-s", type=float, default=3.0, help="seconds between pushes")
    p.add_argument("--out", default=None, help="results folder (bench/results/<date>-<host>/)")
    ns = p.parse_args(argv)
    ns.model = ns.model.expanduser()
    if not (ns.model / "config.json").exists():
        p.error(f"--model {ns.model}: no config.json there (make real-model writes one)")
    return ns


def main(argv: list[str] | None = None) -> Path:
    ns = parse(argv)
    folder = Path(ns.out) if ns.out else results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with scratch("millstream-engine-push-") as work:
        result = measure(ns, work)
    path = folder / "engine-push.json"
    path.write_bytes(orjson.dumps({"machine": machine(), **result}, option=orjson.OPT_INDENT_2))
    for key, value in result["summary"].items():
        print(f"{key}: median {value['median']:.3f} ({value['min']:.3f}-{value['max']:.3f})")
    print(path)
    return path


if __name__ == "__main__":
    main()
