"""vLLM's CPU engine on the tiny model with no connector: greedy outputs repeat across engines
(the reference every connector test compares against), and the OpenAI server answers token-id
completions and serves its metrics."""

from __future__ import annotations

from tests.vllm.engine_proc import run_offline, start_server

VOCAB = 512
FIRST_ID = 3  # below are <s>, </s>, <pad>


def random_prompts(rng, lengths):
    return [[rng.randrange(FIRST_ID, VOCAB) for _ in range(n)] for n in lengths]


def test_offline_greedy_repeats(tiny_model, rng):
    # irregular lengths: under a block, across a block boundary, several blocks and a bit
    prompts = random_prompts(rng, [rng.randint(5, 31), rng.randint(33, 63), rng.randint(97, 150)])
    first = run_offline(tiny_model, prompts, max_tokens=12, enable_prefix_caching=False)
    second = run_offline(tiny_model, prompts, max_tokens=12, enable_prefix_caching=False)
    ids = [o["token_ids"] for o in first["outputs"]]
    assert ids == [o["token_ids"] for o in second["outputs"]]
    assert all(len(t) == 12 for t in ids), ids
    assert all(0 <= t < VOCAB for seq in ids for t in seq)
    assert [o["num_cached_tokens"] for o in first["outputs"]] == [0, 0, 0]
    assert first["metrics"]["vllm:generation_tokens"] == 36, first["metrics"]


def test_server_completes_and_serves_metrics(tiny_model, rng):
    (prompt,) = random_prompts(rng, [rng.randint(40, 90)])
    with start_server(tiny_model) as server:
        response = server.complete(prompt, max_tokens=6)
        again = server.complete(prompt, max_tokens=6)
        metrics = server.metrics()
    choice = response["choices"][0]
    assert len(choice["token_ids"]) == 6, response
    assert again["choices"][0]["token_ids"] == choice["token_ids"]
    assert response["usage"]["prompt_tokens"] == len(prompt)
    # the repeat finds the first request's full blocks in vLLM's own prefix cache
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (len(prompt) - 1) // 32 * 32, again["usage"]
    assert "vllm:prompt_tokens" in metrics and "vllm:" in metrics
