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
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"hidden={hidden} must divide by heads={heads} and heads by kv_heads={kv_heads}"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab, max_positions)
    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    ).save_pretrained(path)
    (path / "tiny_model.json").write_text(json.dumps({"seed": seed, "vocab": vocab}))
    return path
