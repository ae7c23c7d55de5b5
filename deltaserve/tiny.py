"""`deltaserve make-tiny`: a small random checkpoint of a registered family in its official layout (config.json,
sharded safetensors with the original tensor names, index, a Kimi tokenizer), deterministic for a seed."""
from __future__ import annotations

import base64
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .chat import KIMI_TEMPLATE
from .checkpoint import INDEX
from .models.registry import spec_for


def make_tiny(dst: str | Path, seed: int = 0, dtype: str = "bfloat16", shards: int = 2, preset: str = "tiny",
              architecture: str = "KimiLinearForCausalLM", **overrides: Any) -> Path:
    """Write the checkpoint; `overrides` replace top-level config.json fields of the family's preset."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    spec = spec_for({"architectures": [architecture]})
    if preset not in spec.tiny_presets:
        raise ValueError(f"--preset {preset!r}: {architecture} has presets {sorted(spec.tiny_presets) or 'none'}")
    raw = {**spec.tiny_presets[preset], **overrides, "dtype": dtype}
    cfg = spec.parse_config(raw, None)
    with torch.device("meta"):
        names = {n: tuple(t.shape) for n, t in spec.model(cfg).checkpoint_map().items()}
    gen = torch.Generator().manual_seed(seed)
    store = getattr(torch, dtype)
    tensors = {n: spec.random_weight(n, names[n], gen).to(torch.float32 if n.endswith(spec.fp32_tensors) else store)
               for n in sorted(names)}
    # Split by layer, as published checkpoints are: consecutive layers per shard, globals in the last.
    layer_of = lambda n: int(n.split(".")[2]) if n.startswith("model.layers.") else cfg.num_hidden_layers
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {n: files[min(layer_of(n) * shards // (cfg.num_hidden_layers + 1), shards - 1)] for n in tensors}
    for file in files:
        save_file({n: t.contiguous() for n, t in tensors.items() if weight_map[n] == file}, dst / file,
                  metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    write_tokenizer(dst, cfg.vocab_size)
    return dst


# Kimi's named special tokens, by offset from the first special id (tokenizer_config.json of the K2 family).
KIMI_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                 6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                 11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
                 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>"}
CORPUS = """The quick brown fox jumps over the lazy dog. A delta rule keeps a fast-weight memory of keys and values;
the recurrent state is updated one token at a time, or a whole chunk at once. Hello, world! How are you today?
I am fine, thank you. What is the answer to this question? Let me think about it: the answer is forty-two.
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols + - * / = ( ) [ ] { } < > are common in code and math.
Café naïve résumé über straße 你好世界 こんにちは 😀 🚀
def forward(self, x): return self.norm(x + self.mixer(x)) # a residual block in Python
"""


def train_bpe(text: str, merges: int) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then the most frequent adjacent pair, merged `merges` times."""
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter(tuple(bytes([b]) for b in w.encode()) for w in re.findall(r" ?\w+| ?[^\w\s]+|\s+", text))
    for _ in range(merges):
        pairs: Counter = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))           # deterministic tie-break
        ranks[best[0] + best[1]] = len(ranks)
        merged: Counter = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return ranks


def write_tokenizer(dst: Path, vocab_size: int) -> None:
    """tiktoken.model, tokenizer_config.json and chat_template.jinja in Kimi's layout, for a small vocabulary:
    256 reserved special ids at the top of large vocabularies, 32 in tiny ones."""
    reserved = 256 if vocab_size >= 4096 else 32
    first_special = min(vocab_size - reserved, 480)
    ranks = train_bpe(CORPUS * 4, first_special - 256)
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in ranks.items()]
    (dst / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = vocab_size - reserved
    named = {base + k: v for k, v in KIMI_SPECIALS.items()}
    named.update({base + reserved - 2: "[UNK]", base + reserved - 1: "[PAD]"})
    config = {
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for i, t in sorted(named.items())},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "model_max_length": 1048576, "tokenizer_class": "TikTokenTokenizer",
    }
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (dst / "chat_template.jinja").write_text(KIMI_TEMPLATE)
