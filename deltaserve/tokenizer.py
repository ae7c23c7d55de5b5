"""Tokenizers: Kimi's tiktoken BPE (`tiktoken.model` + `tokenizer_config.json`), or `tokenizer.json` through
HF `tokenizers`; plus incremental detokenization that never emits half a UTF-8 character."""
from __future__ import annotations

import base64
import binascii
import json
import re
from pathlib import Path
from typing import Any

# The most ids a tiktoken checkpoint's block of special tokens may span (Kimi's: 256)
MAX_SPECIAL_BLOCK = 1 << 16
# Kimi's pre-tokenizer (tokenization_kimi.py); `&&` class intersection needs tiktoken's fancy-regex engine.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


class TokenizerError(ValueError):
    pass


class Tokenizer:
    """Text <-> ids for one checkpoint, with its special tokens, stop ids and chat template."""

    def __init__(self, path: str | Path, eos_token_ids: tuple[int, ...] = ()):
        root = Path(path)
        self.config: dict[str, Any] = _read_json(root / "tokenizer_config.json") or {}
        if (root / "tiktoken.model").exists():
            self._init_tiktoken(root / "tiktoken.model")
        elif (root / "tokenizer.json").exists():
            self._init_hf(root / "tokenizer.json")
        else:
            raise TokenizerError(f"{root}: no tokenizer (expected tiktoken.model or tokenizer.json)")
        generation = _read_json(root / "generation_config.json") or {}
        extra = generation.get("eos_token_id")
        extra = extra if isinstance(extra, list) else [extra] if extra is not None else []
        self.eos_token_ids = tuple(dict.fromkeys([*eos_token_ids, *extra]))
        self.chat_template = self._find_template(root)
        specials = sorted((t for t, i in self._token_to_id.items() if i in self.special_ids), key=len, reverse=True)
        self.special_text = re.compile("|".join(map(re.escape, specials)) or "(?!)")   # longest first

    def _init_tiktoken(self, file: Path) -> None:
        import tiktoken
        ranks = _read_ranks(file)
        config_file = file.parent / "tokenizer_config.json"
        named = _named_specials(self.config, config_file)
        # The special block: the named ids and the reserved ones between them (Kimi: 256 ids after the ranks).
        block = range(min(named), max(named) + 1) if named else range(len(ranks), len(ranks) + 256)
        if len(block) > MAX_SPECIAL_BLOCK or min(block) < 0:
            raise TokenizerError(f"{config_file}: added_tokens_decoder spans ids "
                                 f"{min(block)}..{max(block)}, not a block of at most {MAX_SPECIAL_BLOCK}")
        specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in block}
        # HF semantics: an added token marked "special": false (e.g. <think> in some Kimi releases) is kept by
        # skip_special_tokens; the reserved ids are special
        decoder = self.config.get("added_tokens_decoder", {})
        self._skipped = {i for i in block if decoder.get(str(i), {}).get("special", True)}
        self._enc = tiktoken.Encoding(name=file.parent.name or "kimi", pat_str=KIMI_PAT_STR,
                                      mergeable_ranks=ranks, special_tokens=specials)
        self.special_ids = set(specials.values())
        self._token_to_id = specials
        self._ordinary = range(len(ranks))
        # each token covers at most this many bytes of text (so at most as many characters)
        self._longest_token: int | None = max(map(len, [*ranks, *(t.encode() for t in specials)]))
        self._encode = lambda text: self._enc.encode(text, allowed_special="all")
        self._encode_plain = lambda text: self._enc.encode(text, allowed_special=set(), disallowed_special=())
        self._decode = lambda ids: self._enc.decode(ids)
        self._token_bytes = self._enc.decode_single_token_bytes

    def _init_hf(self, file: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer
        self._hf = HFTokenizer.from_file(str(file))
        self.special_ids = {i for i, t in self._hf.get_added_tokens_decoder().items() if t.special}
        self._skipped = self.special_ids
        self._token_to_id = {t.content: i for i, t in self._hf.get_added_tokens_decoder().items()}
        self._ordinary = range(self._hf.get_vocab_size(with_added_tokens=True))
        self._longest_token = None            # a normalizer may shrink text before it is split: no safe bound
        self._encode = lambda text: self._hf.encode(text, add_special_tokens=False).ids
        plain = HFTokenizer.from_file(str(file))      # a second instance: the flag is per tokenizer, not per call
        plain.encode_special_tokens = True
        self._encode_plain = lambda text: plain.encode(text, add_special_tokens=False).ids
        self._decode = lambda ids: self._hf.decode(ids, skip_special_tokens=False)
        self._token_bytes = lambda i: self._hf.decode([i], skip_special_tokens=False).encode()

    def _find_template(self, root: Path) -> str | None:
        if (root / "chat_template.jinja").exists():
            return (root / "chat_template.jinja").read_text()
        template = self.config.get("chat_template")
        if isinstance(template, list):     # [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template

    def token_id(self, text: str) -> int | None:
        return self._token_to_id.get(text)

    def encode(self, text: str) -> list[int]:
        """Special-token text becomes special ids, as Kimi's tokenizer does; no BOS is added."""
        return self._encode(text)

    def encode_plain(self, text: str) -> list[int]:
        """Special-token text is encoded as the ordinary text it is: no special id can come out."""
        return self._encode_plain(text)

    def encode_with_literals(self, text: str, literals: dict[str, str]) -> list[int]:
        """Encode `text` in which each key of `literals` (a placeholder) stands for its value, which is plain text.
        Special tokens elsewhere in `text` become special ids; the text between them, literals included, is encoded
        in one piece, as `encode` splits text at special tokens, so the ids equal `encode`'s wherever the literals
        hold no special-token text."""
        if not literals:
            return self.encode(text)
        marks = re.compile("|".join(map(re.escape, literals)) + "|" + self.special_text.pattern)
        ids: list[int] = []
        run, start = "", 0
        for m in marks.finditer(text):
            run += text[start:m.start()]
            start = m.end()
            if m.group() in literals:
                run += literals[m.group()]
                continue
            ids += self.encode_plain(run) + [self._token_to_id[m.group()]]
            run = ""
        return ids + self.encode_plain(run + text[start:])

    def fewest_tokens(self, text_chars: int) -> int:
        """A lower bound on the tokens of any text of `text_chars` characters (0 when unknown): lets a prompt that
        cannot fit the context be refused without spending seconds tokenizing megabytes."""
        return text_chars // self._longest_token if self._longest_token else 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """`skip_special_tokens`: drop the special tokens (those the tokenizer config marks special), as HF does."""
        # ids the vocabulary lacks (a random model can sample them) decode to nothing
        keep = [i for i in ids if (not skip_special_tokens or i not in self._skipped)
                and (i in self._ordinary or i in self.special_ids)]
        return self._decode(keep)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token: its text); b"" for an id the vocabulary lacks."""
        if token_id not in self._ordinary and token_id not in self.special_ids:
            return b""
        return self._token_bytes(token_id)


class IncrementalDecoder:
    """Turns a stream of ids into text pieces. A piece is emitted only once the bytes decode to whole
    characters, and text is always decoded from a window starting at a clean boundary. With
    `skip_special_tokens=False`, special tokens come out as their text (tool-call and reasoning markers)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], self.skip)
        after = self.tokenizer.decode(self.ids[self.prefix:], self.skip)
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


def _read_ranks(file: Path) -> dict[bytes, int]:
    """tiktoken.model: one `<base64 token> <rank>` a line, tokens and ranks distinct."""
    ranks: dict[bytes, int] = {}
    lines = [(n, line) for n, line in enumerate(file.read_bytes().splitlines(), 1) if line.strip()]
    for n, line in lines:
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise TokenizerError(f"{file}: line {n} is not '<base64 token> <rank>'") from None
    ids = set(ranks.values())
    if not ranks or not len(lines) == len(ranks) == len(ids) or min(ids) < 0 or max(ids) >= 2 ** 31:
        raise TokenizerError(f"{file}: the tokens and their ranks must be distinct, the ranks in 0..2^31, one a line")
    return ranks


def _named_specials(config: dict[str, Any], file: Path) -> dict[int, str]:
    """tokenizer_config.json's added_tokens_decoder: {"<id>": {"content": ...}} -> {id: content}."""
    problem = TokenizerError(f'{file}: added_tokens_decoder must map ids to {{"content": "<token>"}}')
    try:
        named = {int(i): t["content"] for i, t in config.get("added_tokens_decoder", {}).items()}
    except (AttributeError, KeyError, TypeError, ValueError):
        raise problem from None
    if not all(isinstance(content, str) for content in named.values()):
        raise problem
    return named


def _read_json(file: Path) -> dict[str, Any] | None:
    if not file.exists():
        return None
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{file}: not valid JSON ({e})") from None
