"""tools/fixtures/tiny_server.py samples at temperature > 0: a request's seed decides its reply, whatever else
is batched with it, and the tokens follow softmax(logits / T) of the target itself.
Greedy replies and the server's faults are tested through dflash-data regenerate (test_regenerate.py)."""

from __future__ import annotations

import json
import math
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.helpers.chats import chat_target, running
from tools.fixtures.tiny_server import TinyChatModel, make_server

TEMPERATURE = 0.7
MESSAGES = [{"role": "user", "content": "What does the weather do in spring?"}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> TinyChatModel:
    target = chat_target(tmp_path_factory, mixer_scale=0.1)
    return TinyChatModel(target, max_batch=64)


def _ask(url: str, seed: int, max_tokens: int, temperature: float = TEMPERATURE) -> str:
    """The reply's text, over HTTP as dflash-data regenerate asks."""
    body = {"model": "tiny", "messages": MESSAGES, "temperature": temperature, "seed": seed, "max_tokens": max_tokens}
    body["chat_template_kwargs"] = {"enable_thinking": False}
    request = urllib.request.Request(
        f"{url}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())["choices"][0]["message"]["content"]


def _prompt_ids(model: TinyChatModel) -> list[int]:
    text = model.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, enable_thinking=False, tokenize=False
    )
    return model.tokenizer(text, add_special_tokens=False)["input_ids"]


def _next_token_distribution(model: TinyChatModel, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, softmax(logits / T) in float64) after `ids`, one sequence alone, most likely first."""
    seq = torch.tensor(ids)
    cu = torch.tensor([0, len(ids)], dtype=torch.int32)
    _, top_ids, top_logprobs = model.model.topk_next_tokens(seq, torch.arange(len(ids)), cu, [0], k=model.vocab_size)
    return top_ids[-1].long(), torch.softmax(top_logprobs[-1].double() / TEMPERATURE, dim=-1)


def _sequential_reference(model: TinyChatModel, seed: int, max_tokens: int) -> str:
    """The seeded reply one sequence at a time, no batching: each token drawn from _next_token_distribution
    with the request's generator (what the server must give whatever else it serves at the same time)."""
    ids = _prompt_ids(model)
    generator = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_tokens):
        tokens, probs = _next_token_distribution(model, ids + out)
        out.append(int(tokens[torch.multinomial(probs, 1, generator=generator)]))
        if out[-1] in model.stop_ids:
            break
    return model.tokenizer.decode(out, skip_special_tokens=True)


def test_a_seed_decides_the_sampled_reply_whatever_is_batched_with_it(chat_model):
    with running(make_server(chat_model, 0)) as url:
        alone = _ask(url, seed=3, max_tokens=12)
        with ThreadPoolExecutor(16) as pool:  # the same request among 15 others with other seeds
            together = list(pool.map(lambda s: _ask(url, seed=s, max_tokens=12), [3, *range(100, 115)]))
        greedy = _ask(url, seed=3, max_tokens=12, temperature=0.0)
    assert together[0] == alone == _sequential_reference(chat_model, seed=3, max_tokens=12)
    assert len(set(together)) > 8, "other seeds must give other replies"
    assert alone != greedy


def test_sampled_first_tokens_follow_the_targets_softmax_at_the_temperature(chat_model):
    num_draws = 600
    with running(make_server(chat_model, 0)) as url, ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(lambda s: _ask(url, seed=s, max_tokens=1), range(num_draws)))
    tokens, probs = _next_token_distribution(chat_model, _prompt_ids(chat_model))
    # Replies are text: a token's share is that of its text (tokens that decode alike pooled).
    by_text: dict[str, float] = {}
    for token, p in zip(tokens.tolist(), probs.tolist()):
        text = chat_model.tokenizer.decode([token], skip_special_tokens=True)
        by_text[text] = by_text.get(text, 0.0) + p
    frequent = sorted(by_text, key=by_text.get, reverse=True)[:4]
    assert by_text[frequent[0]] < 0.9, "a near-deterministic first token would test nothing"
    for text in frequent:  # each frequent reply's share within 4.5 binomial standard deviations
        p = by_text[text]
        share = replies.count(text) / num_draws
        assert abs(share - p) <= 4.5 * math.sqrt(p * (1 - p) / num_draws), (text, share, p)


@pytest.mark.gpu
def test_served_on_cuda_a_greedy_reply_is_the_cuda_targets_own(tmp_path_factory):
    model = TinyChatModel(chat_target(tmp_path_factory, mixer_scale=0.1), device="cuda")
    with running(make_server(model, 0)) as url:
        reply = _ask(url, seed=0, max_tokens=12, temperature=0.0)
    ids, out = _prompt_ids(model), []
    for _ in range(12):  # one sequence at a time, greedy, on the same CUDA model (the server's batch of one)
        seq = torch.tensor(ids + out, device="cuda")
        cu = torch.tensor([0, len(seq)], dtype=torch.int32, device="cuda")
        _, top, _ = model.model.topk_next_tokens(seq, torch.arange(len(seq), device="cuda"), cu, [0], k=1)
        out.append(int(top[-1, 0]))
        if out[-1] in model.stop_ids:
            break
    assert reply == model.tokenizer.decode(out, skip_special_tokens=True)
