"""Embedded engine throughput and log-prob agreement, measured side by side in one run.

For 1, 8 and 32 concurrent requests (same prompts, same number of new tokens) it times:
- engine: every request sent at once to `EmbeddedEngine` (continuous batching, shared KV cache);
- per-request generate: one `model.generate` (with its KV cache) per request, one at a time,
  as a server without batching would serve them.
Each configuration runs `--rounds` times, alternating the two; the medians are reported with
their ratio. Then the engine's sampled-token log-probs are compared with a teacher-forced
forward pass of the same model (max absolute difference).

    python benchmarks/inference.py [--model DIR] [--rounds 3] [--new-tokens 128] [--prompt-tokens 64]

Without `--model` it uses a fresh tiny model (patchgym.models.tiny). Target: >= 3x aggregate
throughput at 32 concurrent requests.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from transformers import AutoModelForCausalLM

from patchgym.backends.inference.embedded import EmbeddedEngine
from patchgym.core.inference import SamplingParams
from patchgym.models.tiny import init_tiny_model

console = Console()


def make_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length - i % 8)] for i in range(count)]


async def engine_round(engine: EmbeddedEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    start = time.perf_counter()
    generations = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return time.perf_counter() - start, sum(len(g.token_ids) for g in generations)


def generate_round(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    produced = 0
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                use_cache=True,
            )
            produced += out.shape[1] - ids.shape[1]
    return time.perf_counter() - start, produced


async def logprob_agreement(engine: EmbeddedEngine, model: torch.nn.Module, prompts: list[list[int]]) -> float:
    params = SamplingParams(max_new_tokens=64, temperature=1.0, seed=0)
    generations = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    worst = 0.0
    with torch.no_grad():
        for prompt, generation in zip(prompts, generations, strict=True):
            full = torch.tensor([prompt + list(generation.token_ids)])
            logprobs = torch.log_softmax(model(full).logits[0].float(), dim=-1)
            for i, (token, logprob) in enumerate(zip(generation.token_ids, generation.logprobs, strict=True)):
                worst = max(worst, abs(logprobs[len(prompt) - 1 + i, token].item() - logprob))
    return worst


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(args.model) if args.model else init_tiny_model(Path(scratch) / "tiny")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        engine = EmbeddedEngine(model_dir, max_context=args.prompt_tokens + args.new_tokens + 8, max_batch_size=32)
        vocab = int(model.config.vocab_size)
        console.print(f"model {model_dir}; engine settings {engine.settings()}")
        table = Table(
            "concurrent", "engine tok/s (median)", "per-request generate tok/s (median)", "ratio", title="throughput"
        )
        try:
            await engine_round(engine, make_prompts(2, 16, vocab), 8)  # warm-up
            levels = [int(n) for n in args.concurrency.split(",")]
            with Progress(console=console, transient=True) as progress:
                bar = progress.add_task("rounds", total=len(levels) * args.rounds)
                for level in levels:
                    prompts = make_prompts(level, args.prompt_tokens, vocab, seed=level)
                    engine_rates, generate_rates = [], []
                    for _ in range(args.rounds):
                        seconds, tokens = await engine_round(engine, prompts, args.new_tokens)
                        engine_rates.append(tokens / seconds)
                        seconds, tokens = await asyncio.to_thread(generate_round, model, prompts, args.new_tokens)
                        generate_rates.append(tokens / seconds)
                        progress.advance(bar)
                    engine_rate, generate_rate = statistics.median(engine_rates), statistics.median(generate_rates)
                    table.add_row(
                        str(level),
                        f"{engine_rate:,.0f}",
                        f"{generate_rate:,.0f}",
                        f"{engine_rate / generate_rate:.2f}x",
                    )
            console.print(table)
            worst = await logprob_agreement(engine, model, make_prompts(8, args.prompt_tokens, vocab, seed=99))
            verdict = "OK" if worst < 1e-4 else "ABOVE 1e-4"
            console.print(
                f"log-prob agreement with a teacher-forced forward pass: max |diff| = {worst:.2e} ({verdict})"
            )
        finally:
            await engine.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face model folder (default: a fresh tiny model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    asyncio.run(main(parser.parse_args()))
