"""The token-level chat: appending equals the template's rendering for ChatML; nothing is re-tokenised."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_train_extra

require_train_extra()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from patchgym.core.chat import ChatTemplateError, TokenChat  # noqa: E402
from patchgym.core.errors import ConfigError  # noqa: E402
from patchgym.core.inference import Generation, SamplingParams  # noqa: E402

MESSAGES = [
    {"role": "system", "content": "You are a software engineer.\nUse bash."},
    {"role": "user", "content": "Fix the bug in héllo.py ✓\n\n    def f(x): return x"},
]
TURNS = [
    ("I will look.\n```bash\ncat héllo.py\n```", "def f(x):\n    return x + 1\n"),
    ("Now the tests.\n```bash\npytest -q\n```", "<returncode>1</returncode>\n<output>\n1 failed\n</output>"),
    ("", "   leading spaces and\ttabs\n\n"),
    ("Done.\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```", "日本 → ß"),
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def sampled(tokenizer: Any, text: str, *, close: bool = True, version: int = 0) -> Generation:
    """What an engine returns when it samples the canonical tokens of `text`."""
    ids = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.convert_tokens_to_ids("<|im_end|>")] * close)
    return Generation(ids, [-0.5] * len(ids), "stop" if close else "length", version)


def test_appended_tokens_equal_the_template_rendering(tokenizer: Any) -> None:
    chat = TokenChat.start(tokenizer, MESSAGES)
    messages = list(MESSAGES)
    for version, (assistant, observation) in enumerate(TURNS):
        text = chat.add_generation(sampled(tokenizer, assistant, version=version))
        assert text == assistant
        chat.add_observation([{"role": "user", "content": observation}])
        messages += [{"role": "assistant", "content": assistant}, {"role": "user", "content": observation}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert chat.token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert chat.policy_versions == [0, 1, 2, 3]
    assert len(chat.token_ids) == len(chat.loss_mask) == len(chat.logprobs)
    for turn in chat.turns:
        assert chat.loss_mask[turn.start : turn.end] == [1] * (turn.end - turn.start)
        assert chat.logprobs[turn.start : turn.end] == [-0.5] * (turn.end - turn.start)
    assert sum(chat.loss_mask) == sum(turn.end - turn.start for turn in chat.turns)
    assert chat.loss_mask[: chat.prompt_length] == [0] * chat.prompt_length


def test_a_cut_off_turn_is_closed_with_an_unmasked_turn_end(tokenizer: Any) -> None:
    chat = TokenChat.start(tokenizer, MESSAGES)
    chat.add_generation(sampled(tokenizer, "half a thou", close=False))
    end = len(chat)
    chat.add_observation([{"role": "user", "content": "go on"}])
    assert chat.token_ids[end] == chat.turn_end_id and chat.loss_mask[end] == 0
    messages = [*MESSAGES, {"role": "assistant", "content": "half a thou"}, {"role": "user", "content": "go on"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.token_ids == tokenizer.encode(rendered, add_special_tokens=False)


def test_sampled_tokens_are_kept_even_when_not_canonical(tokenizer: Any) -> None:
    """Re-tokenising would merge these single-byte tokens; the chat keeps them as sampled."""
    chat = TokenChat.start(tokenizer, MESSAGES)
    single_bytes = [tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "the test"]
    gen = Generation([*single_bytes, chat.turn_end_id], [-1.0] * 9, "stop", 0)
    assert chat.add_generation(gen) == "the test"
    assert chat.token_ids[-9:] == gen.token_ids
    assert tokenizer.encode("the test", add_special_tokens=False) != single_bytes


def test_thinking_stripping_templates_keep_the_sampled_thinking(tokenizer: Any) -> None:
    """A Qwen3-style template drops earlier <think> blocks on re-render; the token chat keeps them."""
    strip = (
        "{%- for m in messages %}{%- set c = m['content'] %}"
        "{%- if m['role'] == 'assistant' and not loop.last and '</think>' in c %}"
        "{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    tokenizer.chat_template, original = strip, tokenizer.chat_template
    try:
        chat = TokenChat.start(tokenizer, MESSAGES)
        reply = "<think>hmm</think>\n```bash\nls\n```"
        chat.add_generation(sampled(tokenizer, reply))
        chat.add_observation([{"role": "user", "content": "a.py"}])
        messages = [*MESSAGES, {"role": "assistant", "content": reply}, {"role": "user", "content": "a.py"}]
        rerendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert "hmm" in tokenizer.decode(chat.token_ids) and "hmm" not in rerendered
    finally:
        tokenizer.chat_template = original


def test_templates_that_rewrite_history_are_refused(tokenizer: Any) -> None:
    counting = (
        "{{- 'turns=' + (messages | length | string) + '\\n' }}"
        "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    tokenizer.chat_template, original = counting, tokenizer.chat_template
    try:
        chat = TokenChat.start(tokenizer, MESSAGES)
        chat.add_generation(sampled(tokenizer, "x"))
        with pytest.raises(ChatTemplateError, match="appending"):
            chat.add_observation([{"role": "user", "content": "y"}])
    finally:
        tokenizer.chat_template = original


def test_misuse_is_a_clear_error(tokenizer: Any) -> None:
    chat = TokenChat.start(tokenizer, MESSAGES)
    with pytest.raises(ConfigError, match="must follow add_generation"):
        chat.add_observation([{"role": "user", "content": "y"}])
    chat.add_generation(sampled(tokenizer, "x"))
    with pytest.raises(ConfigError, match="must come between"):
        chat.add_generation(sampled(tokenizer, "x"))
    with pytest.raises(ConfigError, match="log-probs"):
        TokenChat.start(tokenizer, MESSAGES).add_generation(Generation([1, 2], [0.0], "stop", 0))


async def test_engine_rollout_logprobs_match_a_forward_pass_over_the_chat(tiny_model_dir: Path, tokenizer: Any) -> None:
    """A multi-turn rollout on the embedded engine: the trainer's view equals the engine's tokens."""
    from patchgym.backends.inference.embedded import EmbeddedEngine

    engine = EmbeddedEngine(tiny_model_dir, max_context=1024)
    try:
        chat = TokenChat.start(tokenizer, MESSAGES)
        for observation in ("out 1", "out 2", "out 3"):
            params = SamplingParams(max_new_tokens=30, temperature=1.0, stop_token_ids=chat.stop_token_ids, seed=1)
            chat.add_generation(await engine.generate(chat.token_ids, params))
            chat.add_observation([{"role": "user", "content": observation}])
        await asyncio.sleep(0)
    finally:
        await engine.aclose()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([chat.token_ids])).logits[0].float(), dim=-1)
    for i, (token, mask) in enumerate(zip(chat.token_ids, chat.loss_mask, strict=True)):
        if mask:
            assert abs(logprobs[i - 1, token].item() - chat.logprobs[i]) < 1e-4
    assert sum(chat.loss_mask) > 0 and len(chat.turns) == 3
