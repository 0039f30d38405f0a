"""A tiny random Llama for vLLM's CPU engine, built from nothing downloaded.

``build_tiny_llama`` writes a Hugging Face model directory that ``transformers`` and vLLM load
offline (``HF_HUB_OFFLINE=1``): a byte-level BPE tokenizer trained by ``tokenizers`` on a fixed
generated corpus, and a ``LlamaConfig`` with seeded random float32 weights (safetensors). The
model says nothing useful; it exists so that the KV cache vLLM computes, stores and reloads has
the shape of a real Llama's (grouped-query attention, rotary positions, several layers)."""

from __future__ import annotations

import json
import random
from pathlib import Path

BOS, EOS = "<s>", "</s>"
SPECIAL_TOKENS = [BOS, EOS, "<pad>"]
# The corpus is fixed (not drawn from `seed`): the tokenizer is the same for every model built.
CORPUS_SEED = 20240611
SYLLABLES = [
    "ka", "lo", "mi", "ne", "ru", "ta", "shi", "vo", "pe", "dan", "qua", "zor", "el", "im", "ost",
    "ber", "cal", "fin", "gul", "hex", "jor", "kin", "lum", "mor", "nix", "pol", "rin", "sul",
]  # fmt: skip


def corpus(lines: int = 4000) -> list[str]:
    """Generated sentences: words of 1-4 syllables, digits and punctuation."""
    rng = random.Random(CORPUS_SEED)
    out = []
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(3, 14)):
            word = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))
            if rng.random() < 0.1:
                word = word.capitalize()
            if rng.random() < 0.05:
                word = str(rng.randint(0, 9999))
            words.append(word)
        out.append(" ".join(words) + rng.choice([".", "!", "?", ",", ";", ":"]))
    return out


def build_tokenizer(vocab: int, max_positions: int):
    """A ``PreTrainedTokenizerFast`` with exactly ``vocab`` tokens (<s>=0, </s>=1, <pad>=2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size() != vocab:
        raise ValueError(
            f"the tokenizer has {tok.get_vocab_size()} tokens, not vocab={vocab}: the corpus is "
            f"too small for it (vocab must be at least {256 + len(SPECIAL_TOKENS)})"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token="<pad>",
        model_max_length=max_positions,
    )


def build_tiny_llama(
    path: str | Path,
    *,
    seed: int,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    max_positions: int = 2048,
) -> Path:
    """Write the model directory at ``path`` (created) and return it.

    ``hidden // heads`` is the head size: vLLM's CPU attention takes 32, 64, 80, ... (not 16), so
    the defaults give 32. Weights are drawn from ``seed``; the tokenizer does not depend on it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"hidden={hidden} must divide by heads={heads} and heads by kv_heads={kv_heads}"
        )
    return _write_model(
        path, seed, vocab, max_positions, LlamaConfig, LlamaForCausalLM,
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        tie_word_embeddings=False,
    )  # fmt: skip


def build_tiny_gemma3(
    path: str | Path, *, seed: int, sliding_window: int = 64, vocab: int = 512
) -> Path:
    """A 4-layer Gemma-3 text model (``Gemma3ForCausalLM``): sliding-window layers (window
    ``sliding_window``) and full-attention layers alternating, so vLLM's hybrid manager keeps a
    ``SlidingWindowSpec`` group and a ``FullAttentionSpec`` group. Float32, head size 32."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return _write_model(
        path, seed, vocab, 2048, Gemma3TextConfig, Gemma3ForCausalLM,
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=32,
        tie_word_embeddings=True,
    )  # fmt: skip


def build_tiny_qwen3_next(path: str | Path, *, seed: int, vocab: int = 512) -> Path:
    """A 4-layer Qwen3-Next (``Qwen3NextForCausalLM``): gated-delta-net (linear attention)
    layers and full-attention layers alternating, dense MLPs but the last layer's (vLLM's
    Qwen3-Next wants one mixture of experts: 4 experts, 2 per token), bfloat16 (vLLM's CPU
    gated-delta-net needs it, and a linear-attention head size of 128)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return _write_model(
        path, seed, vocab, 4096, Qwen3NextConfig, Qwen3NextForCausalLM, dtype="bfloat16",
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=1, linear_num_value_heads=2,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"] * 2, mlp_only_layers=[0, 1, 2],
        decoder_sparse_step=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        tie_word_embeddings=False,
    )  # fmt: skip


def _write_model(path, seed, vocab, max_positions, config_cls, model_cls, dtype="float32", **kw):
    """The model directory: tokenizer, config, seeded random weights in ``dtype``, generation
    config (greedy)."""
    import torch
    from transformers import GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab, max_positions)
    tokenizer.save_pretrained(path)
    config = config_cls(
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=dtype,
        **kw,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    ).save_pretrained(path)
    (path / "tiny_model.json").write_text(json.dumps({"seed": seed, "vocab": vocab}))
    return path
