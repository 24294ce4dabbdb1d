"""The `acme-scripted` inference backend: a scripted policy behind the `InferenceEngine` contract.

It reads the conversation's tokens and plays an acme-ledger agent, one message per turn:
1. `cat invoices.txt`;
2. the sum of the amounts in that command's output (its observation), written to `total.txt`;
3. the submit command.
With `mistake_rate` > 0 it leaves the last invoice out of the sum that often, so the rewards of a
GRPO group differ. A turn is the canonical tokens of its text and the turn-end token, each with
log-prob 0 (the policy is deterministic), tagged with the version of the last `update_weights`:
a script has no weights, so it only records the version. It keeps the contract's caps
(`max_new_tokens` ends a turn with "length", `max_context` with "context") and `pause()` holds
new generations until `resume()`.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Sequence
from typing import Any

from patchgym.core.actions import SUBMIT_SENTINEL
from patchgym.core.errors import ConfigError
from patchgym.core.inference import Generation, SamplingParams
from transformers import AutoTokenizer

from acme_patchgym.tasks import INVOICES, TOTAL

READ = f"```bash\ncat {INVOICES}\n```"
WRITTEN = f"> {TOTAL}\n```"
SUBMIT = f"```bash\necho {SUBMIT_SENTINEL}\n```"
INVOICE_LINE = re.compile(r"^[a-z][\w-]* (\d+)$", re.MULTILINE)


class ScriptedEngine:
    """See the module docstring. `model` is the run's model folder: its tokenizer is used."""

    def __init__(self, model: str, max_context: int = 4096, mistake_rate: float = 0.0, seed: int = 0) -> None:
        if not 0.0 <= mistake_rate <= 1.0:
            raise ConfigError(f"acme-scripted mistake_rate must lie in [0, 1], got {mistake_rate}")
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.max_context = max_context
        self.mistake_rate = mistake_rate
        self.seed = seed
        self.weight_version = 0
        self._rng = random.Random(seed)
        self._running = asyncio.Event()
        self._running.set()

    def next_message(self, conversation: str) -> str:
        """The policy: what to say after `conversation` (the decoded prompt)."""
        if READ not in conversation:
            return READ
        if WRITTEN not in conversation:
            amounts = [int(a) for a in INVOICE_LINE.findall(conversation.rsplit(READ, 1)[1])]
            if amounts and self._rng.random() < self.mistake_rate:
                amounts.pop()
            return f"```bash\necho {sum(amounts)} {WRITTEN}"
        return SUBMIT

    async def generate(self, input_ids: Sequence[int], params: SamplingParams) -> Generation:
        await self._running.wait()
        room = min(params.max_new_tokens, self.max_context - len(input_ids))
        if room <= 0:
            return Generation([], [], "context", self.weight_version)
        text = self.next_message(self.tokenizer.decode(list(input_ids)))
        turn_end = list(params.stop_token_ids[:1]) or [self.tokenizer.eos_token_id]
        tokens = [*self.tokenizer.encode(text, add_special_tokens=False), *turn_end]
        stop = next(i for i, token in enumerate(tokens) if token in params.stop_token_ids or token in turn_end)
        tokens, finish = tokens[: stop + 1], "stop"
        if len(tokens) > room:
            tokens = tokens[:room]
            finish = "length" if room == params.max_new_tokens else "context"
        return Generation(tokens, [0.0] * len(tokens), finish, self.weight_version)

    async def update_weights(self, weights: Any, *, version: int) -> None:
        self.weight_version = version

    async def pause(self) -> None:
        self._running.clear()

    async def resume(self) -> None:
        self._running.set()

    async def aclose(self) -> None:
        self._running.set()

    def settings(self) -> dict[str, Any]:
        return {"max_context": self.max_context, "mistake_rate": self.mistake_rate, "seed": self.seed}
